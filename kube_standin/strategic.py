"""Strategic merge patch: a port of ``apimachinery/pkg/util/strategicpatch``, server side.

With the Node's struct tags: ``status.conditions`` and ``status.addresses`` merge by ``type``,
``metadata.ownerReferences`` by ``uid``, ``metadata.finalizers`` and ``spec.podCIDRs`` are merged
sets, and every other list (``spec.taints`` included: it has no ``patchStrategy``) is replaced
whole. ``$patch`` (``replace``/``delete``), ``$retainKeys``, ``$setElementOrder/`` and
``$deleteFromPrimitiveList/`` are honoured, and so is the ordering.
"""

from __future__ import annotations

import copy
from typing import Any

from kube_standin.schema import FIELD_INDEX, SCHEMA
from kube_standin.status import gov


def _gotype(v: Any) -> str:
    """``reflect.TypeOf(v)`` of a decoded-JSON value, for mergepatch's error messages."""
    if v is None:
        return "<nil>"
    return {dict: "map[string]interface {}", list: "[]interface {}", str: "string", bool: "bool",
            int: "int64", float: "float64"}.get(type(v), type(v).__name__)


_DIRECTIVE = "$patch"
_RETAIN_KEYS = "$retainKeys"
_DELETE_PRIMITIVE = "$deleteFromPrimitiveList"
_SET_ORDER = "$setElementOrder"


class SMPError(Exception):
    """An error of the strategic merge; ``code`` 400/422 for mergepatch's sentinels, else 500."""

    def __init__(self, message: str, code: int = 500) -> None:
        super().__init__(message)
        self.code = code


_ERR_BAD_PRIMITIVE_LIST = "invalid patch format of primitive list"
_ERR_BAD_RETAIN_KEYS = "invalid patch format of retainKeys"
_ERR_BAD_SET_ORDER = "invalid patch format of setElementOrder list"


def _smp_lookup(schema: str | None, key: str) -> tuple[str | None, str, str]:
    """(sub-schema, patch strategy, merge key) of ``key`` in a struct or map type."""
    if schema is None:
        return None, "", ""
    if schema.startswith("map[string]"):
        return _smp_elem(schema[11:]), "", ""
    f = FIELD_INDEX.get(schema, {}).get(key)
    if f is None:
        return None, "", ""
    return _smp_elem(f.type), f.strategy, f.key


def _smp_elem(t: str) -> str | None:
    while t.startswith(("*", "[]")):
        t = t[1:] if t.startswith("*") else t[2:]
    return t if (t in SCHEMA or t.startswith("map[")) else None


def _bad_arg_type(expected: str, actual: Any) -> SMPError:
    return SMPError(f"expected a {expected}, but received a {_gotype(actual)}")


def _no_merge_key(m: dict[str, Any], key: str) -> SMPError:
    return SMPError(f"map: {gov(m)} does not contain declared merge key: {key}")


def _remove_directives(obj: Any) -> tuple[Any, bool]:
    if isinstance(obj, dict):
        if _DIRECTIVE in obj:
            return None, False
        out = {}
        for k, v in obj.items():
            nv, keep = _remove_directives(v)
            if keep:
                out[k] = nv
        return out, True
    if isinstance(obj, list):
        return [nv for nv, keep in (_remove_directives(v) for v in obj) if keep], True
    return obj, True


def _discard_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _discard_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_discard_nulls(x) for x in v]
    return v


def _slice_element_type(*slices: list[Any]) -> type:
    prev: type | None = None
    for s in slices:
        for v in s:
            cur = type(v)
            if prev is None:
                prev = cur
                if cur is list:
                    raise SMPError("lists of lists are not supported", 422)
            elif prev is not cur:
                raise SMPError("list element types are not identical: ["
                               + " ".join(gov(x) for x in slices) + "]")
    if prev is None:
        raise SMPError("no elements in any of the given slices")
    return prev


def _merge_value(item: Any, key: str, is_map: bool) -> Any:
    return item.get(key) if (is_map and isinstance(item, dict)) else (None if is_map else item)


def _index(items: list[Any], val: Any, key: str, is_map: bool) -> int:
    want = _merge_value(val, key, is_map)
    for i, v in enumerate(items):
        if _merge_value(v, key, is_map) == want:
            return i
    return -1


def _find_by_key(items: list[Any], key: str, value: Any) -> tuple[dict[str, Any] | None, int]:
    for i, v in enumerate(items):
        if not isinstance(v, dict):
            raise SMPError(f"value for key {i} is not a map")
        if key in v and v[key] == value:
            return v, i
    return None, -1


def _normalize_slice_order(to_sort: list[Any], order: list[Any], key: str, is_map: bool) -> list[Any]:
    to_delete: list[Any] = []
    if is_map:
        for lst in (to_sort, order):
            for item in lst:
                if not isinstance(item, dict):
                    raise _bad_arg_type("map[string]interface {}", item)
                if key not in item:
                    raise _no_merge_key(item, key)
        keep = [v for v in to_sort if v.get(_DIRECTIVE) != "delete"]
        to_delete = [v for v in to_sort if v.get(_DIRECTIVE) == "delete"]
        to_sort = keep
    positions = [_index(order, v, key, is_map) for v in to_sort]
    ranked = sorted(range(len(to_sort)), key=lambda i: (positions[i] < 0, positions[i]))
    if any(p < 0 for p in positions):  # Go's comparator then is not an order: keep them where they are
        ranked = list(range(len(to_sort)))
    return [to_sort[i] for i in ranked] + to_delete


def _merge_sorted(left: list[Any], right: list[Any], server_order: list[Any], key: str,
                  is_map: bool) -> list[Any]:
    out: list[Any] = []
    i = j = 0
    while i < len(left) or j < len(right):
        if i >= len(left):
            out.append(right[j])
            j += 1
        elif j >= len(right):
            out.append(left[i])
            i += 1
        else:
            li, ri = _index(server_order, left[i], key, is_map), _index(server_order, right[j], key, is_map)
            if li >= 0 and ri >= 0 and li < ri:
                out.append(left[i])
                i += 1
            else:
                out.append(right[j])
                j += 1
    return out


def _normalize_element_order(patch: list[Any], server_only: list[Any], patch_order: list[Any],
                             server_order: list[Any], key: str, is_map: bool) -> list[Any]:
    patch = _normalize_slice_order(patch, patch_order, key, is_map)
    server_only = _normalize_slice_order(server_only, server_order, key, is_map)
    return _merge_sorted(server_only, patch, server_order, key, is_map)


def _partition(merged: list[Any], by: list[Any], key: str, is_map: bool) -> tuple[list[Any], list[Any]]:
    if not is_map:
        inside = {v for v in by if not isinstance(v, (dict, list))}
        return ([v for v in merged if _hashable_in(v, inside)],
                [v for v in merged if not _hashable_in(v, inside)])
    patch_items: list[Any] = []
    server_only: list[Any] = []
    for v in merged:
        if not isinstance(v, dict):
            raise _bad_arg_type("map[string]interface {}", v)
        if key not in v:
            raise _no_merge_key(v, key)
        found, _ = _find_by_key(by, key, v[key])
        (patch_items if found is not None else server_only).append(v)
    return patch_items, server_only


def _hashable_in(v: Any, s: set[Any]) -> bool:
    try:
        return v in s
    except TypeError:
        return False


def _dedup_scalars(s: list[Any]) -> list[Any]:
    """``deduplicateScalars``: Go's swap-with-last removal, whose order ``normalizeElementOrder`` fixes."""
    s = list(s)
    length = len(s) - 1
    i = 0
    while i < length:
        j = i + 1
        while j <= length:
            if s[i] == s[j] and type(s[i]) is type(s[j]):
                s[j] = s[length]
                s = s[:length]
                length -= 1
                j -= 1
            j += 1
        i += 1
    return s


def _merge_slice(original: list[Any], patch: list[Any], schema: str | None, key: str,
                 is_delete_list: bool) -> list[Any]:
    if not original and not patch:
        return original
    is_map = _slice_element_type(original, patch) is dict
    if not is_map:
        if is_delete_list:
            return [v for v in original if not _hashable_in(v, {x for x in patch if not isinstance(x, dict)})]
        merged = _dedup_scalars(original + patch)
    else:
        if not key:
            raise SMPError(f"cannot merge lists without merge key for {schema or ''}")
        without: list[Any] = []
        replace = False
        for v in patch:
            if _DIRECTIVE not in v:
                without.append(v)
                continue
            directive = v[_DIRECTIVE]
            if directive == "delete":
                if key not in v:
                    raise _no_merge_key(v, key)
                original = [o for o in original if not (key in o and o[key] == v[key])]
            elif directive == "replace":
                replace = True
            elif directive == "merge":
                raise SMPError("merging lists cannot yet be specified in the patch")
            else:
                raise SMPError(f"unknown patch type: {gov(directive)} in map: {gov(v)}")
        if replace:
            original, patch = without, []
        else:
            patch = without
        merged = list(original)
        for v in patch:
            if key not in v:
                raise _no_merge_key(v, key)
            found, at = _find_by_key(merged, key, v[key])
            if found is not None:
                merged[at] = _merge_map(found, v, schema)
            else:
                merged.append(v)
        original = [merged[i] for i in range(len(original))]
    patch_items, server_only = _partition(merged, patch, key, is_map)
    return _normalize_element_order(patch_items, server_only, patch, original, key, is_map)


def _merge_slice_handler(original: Any, patch: Any, schema: str | None, strategy: str, key: str,
                         is_delete_list: bool) -> list[Any]:
    if not isinstance(original, list):
        raise _bad_arg_type("[]interface {}", original)
    if not isinstance(patch, list):
        raise _bad_arg_type("[]interface {}", patch)
    if strategy == "merge" or is_delete_list:
        return _merge_slice(original, patch, schema, key, is_delete_list)
    return patch


def _retain_strategy(strategy: str) -> str:
    parts = [p for p in strategy.split(",") if p]
    return next((p for p in parts if p != "retainKeys"), "")


def _apply_retain_keys(original: dict[str, Any], patch: dict[str, Any]) -> None:
    if _RETAIN_KEYS not in patch:
        return
    keys = patch.pop(_RETAIN_KEYS)
    if not isinstance(keys, list):
        raise SMPError(_ERR_BAD_RETAIN_KEYS, 400)
    allowed = {k for k in keys if isinstance(k, str)}
    for k, v in patch.items():
        if v is None or k.startswith((_DELETE_PRIMITIVE, _SET_ORDER)):
            continue
        if k not in allowed:
            raise SMPError(_ERR_BAD_RETAIN_KEYS, 400)
    for k in list(original):
        if k not in allowed:
            del original[k]


def _extract_key(s: str, prefix: str) -> str:
    parts = s.split("/", 1)
    if len(parts) <= 1 or parts[0] != prefix:
        raise SMPError(_ERR_BAD_PRIMITIVE_LIST if prefix == _DELETE_PRIMITIVE else _ERR_BAD_SET_ORDER, 400)
    return parts[1]


def _apply_set_element_order(original: dict[str, Any], patch: dict[str, Any], schema: str | None) -> None:
    for k in [k for k in patch if k.startswith(_SET_ORDER)]:
        order = patch.pop(k)
        if not isinstance(order, list):
            raise _bad_arg_type("[]interface {}", order)
        name = _extract_key(k, _SET_ORDER)
        sub, strategy, key = _smp_lookup(schema, name)
        strategy = _retain_strategy(strategy)
        have_orig, have_patch = name in original, name in patch
        orig_list = original.get(name) if have_orig else None
        patch_list = patch.get(name) if have_patch else None
        if have_orig and not isinstance(orig_list, list):
            raise _bad_arg_type("[]interface {}", orig_list)
        if have_patch and not isinstance(patch_list, list):
            raise _bad_arg_type("[]interface {}", patch_list)
        _validate_set_order(patch_list or [], order, key)
        if have_orig and not have_patch:
            merged = orig_list
        elif have_patch and not have_orig:
            merged, _ = _remove_directives(patch_list)
        elif have_orig and have_patch:
            merged = _merge_slice_handler(orig_list, patch_list, sub, strategy, key, False)
        else:
            continue
        assert isinstance(merged, list)
        is_map = bool(key)
        server_order = orig_list or []
        if have_orig and have_patch and is_map and strategy == "merge":
            server_order = _aliased_original(server_order, patch_list or [], key)
        patch_items, server_only = _partition(merged, order, key, is_map)
        original[name] = _normalize_element_order(patch_items, server_only, order, server_order, key, is_map)
        patch.pop(name, None)


def _aliased_original(original: list[Any], patch: list[Any], key: str) -> list[Any]:
    """What Go's ``originalFieldValue`` holds after ``mergeSlice`` ran on the same backing array.

    ``deleteMatchingEntries`` (``append(s[:i], s[i+1:]...)``) and the appends of new items write into
    the array the caller still reads through its own slice header, so ``mergePatchIntoOriginal`` orders
    the result by that mutated list. The array's capacity is the next power of two of its length, as
    Go's ``append``-grown slices from decoding have (what apimachinery's tests exercise).
    """
    n = length = len(original)
    cap = 1 << (length - 1).bit_length() if length else 0
    backing: list[Any] = [{key: v.get(key)} if isinstance(v, dict) else v for v in original]
    backing += [None] * (cap - n)
    shared = True
    for v in patch:
        if not isinstance(v, dict) or _DIRECTIVE not in v:
            continue
        if v[_DIRECTIVE] == "delete" and key in v:
            while True:
                at = next((i for i in range(n) if isinstance(backing[i], dict) and key in backing[i]
                           and backing[i][key] == v[key]), -1)
                if at < 0:
                    break
                backing[at:n - 1] = backing[at + 1:n]
                n -= 1
        elif v[_DIRECTIVE] == "replace":
            shared = False
    for v in patch:
        if not shared or not isinstance(v, dict) or _DIRECTIVE in v or key not in v:
            continue
        if any(isinstance(b, dict) and b.get(key) == v[key] for b in backing[:n]):
            continue  # merged in place: the merge key, all the ordering looks at, is unchanged
        if n < cap:
            backing[n] = {key: v[key]}
            n += 1
        else:
            shared = False  # append reallocated: later writes go to a new array
    return backing[:length]


def _validate_set_order(patch_list: list[Any], order: list[Any], key: str) -> None:
    if not order or not patch_list:
        return
    items = [v for v in patch_list if not (isinstance(v, dict) and v.get(_DIRECTIVE) == "delete")] \
        if key else patch_list
    pi = si = 0
    while pi < len(items) and si < len(order):
        if isinstance(items[pi], dict) and _DIRECTIVE in items[pi]:
            pi += 1
            continue
        if key:
            left, right = items[pi], order[si]
            if not isinstance(left, dict) or not isinstance(right, dict):
                raise _bad_arg_type("map[string]interface {}", right if isinstance(left, dict) else left)
            if key not in left:
                raise _no_merge_key(left, key)
            if key not in right:
                raise _no_merge_key(right, key)
            equal = left[key] == right[key]
        else:
            equal = items[pi] == order[si]
        if equal:
            pi += 1
        si += 1
    if pi < len(items) and si >= len(order):
        raise SMPError(f"The order in patch list:\n{gov(patch_list)}\n doesn't match {_SET_ORDER} list:\n"
                       f"{gov(order)}\n")


def _merge_map(original: dict[str, Any] | None, patch: dict[str, Any], schema: str | None) -> dict[str, Any]:
    """``mergeMap`` with ``MergeParallelList`` and ``IgnoreUnmatchedNulls`` (what the server uses)."""
    patch = dict(patch)
    if _DIRECTIVE in patch:
        directive = patch[_DIRECTIVE]
        if directive == "replace":
            del patch[_DIRECTIVE]
            return patch
        if directive == "delete":
            return {}
        raise SMPError(f"unknown patch type: {gov(directive)} in map: {gov(patch)}")
    original = {} if original is None else dict(original)
    _apply_retain_keys(original, patch)
    _apply_set_element_order(original, patch, schema)
    for k, pv in patch.items():
        is_delete_list = False
        if k.startswith(_DELETE_PRIMITIVE):
            k = _extract_key(k, _DELETE_PRIMITIVE)
            is_delete_list = True
        if pv is None:
            original.pop(k, None)
            continue
        if k not in original:
            if not is_delete_list:
                v, keep = _remove_directives(_discard_nulls(pv))
                if keep:
                    original[k] = v
            continue
        ov = original[k]
        if type(ov) is not type(pv):
            if not is_delete_list:
                v, keep = _remove_directives(_discard_nulls(pv))
                if keep:
                    original[k] = v
                else:
                    del original[k]
            continue
        if isinstance(ov, dict):
            sub, strategy, _ = _smp_lookup(schema, k)
            if _retain_strategy(strategy) != "replace":
                original[k] = _merge_map(ov, pv, sub)
            else:
                original[k] = pv
        elif isinstance(ov, list):
            sub, strategy, key = _smp_lookup(schema, k)
            original[k] = _merge_slice_handler(ov, pv, sub, _retain_strategy(strategy), key, is_delete_list)
        else:
            v, keep = _remove_directives(pv)
            if keep:
                original[k] = v
            else:
                del original[k]
    return original


def strategic_merge(original: dict[str, Any], patch: dict[str, Any], kind: str) -> dict[str, Any]:
    return _merge_map(copy.deepcopy(original), copy.deepcopy(patch), kind)

