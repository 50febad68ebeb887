"""The PATCH bodies served: JSON patch (RFC 6902) and JSON merge patch (RFC 7386).

These are the patch types the product sends (``sdc_guard.remediation`` writes JSON patches
whose first operation pins ``metadata.resourceVersion``) or that tests use to change a node
the way another tool would (merge patch). A strategic-merge patch is not served: the request
is answered 415, as the real server answers one for a type that has no strategic-merge
schema (a custom resource); see the package docstring.

:func:`patched` computes the document a patch produces from the stored object, with the
server's error for a body it cannot apply; what it produces is then decoded, checked and
validated like any update (:meth:`kube_standin.store.Store.update_node`).
"""

from __future__ import annotations

from typing import Any

from kube_standin.schema import json_kind
from kube_standin.status import APIError, err_bad_request, err_generic, failure

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
PATCH_TYPES = (JSON_PATCH, MERGE_PATCH)
"""The content types a PATCH may carry, in the order the 415 message lists them."""

_MAX_JSON_PATCH_OPS = 10000


def patched(content_type: str, current: dict[str, Any], patch: Any, *, strict: bool,
            warnings: list[str]) -> Any:
    """The document ``patch`` (parsed JSON, of a type in :data:`PATCH_TYPES`) makes of ``current``
    (which it may change); ``strict``: ``fieldValidation`` Strict or Warn, whose unknown fields of
    JSON-patch operations are appended to ``warnings``."""
    if content_type == JSON_PATCH:
        return apply_json_patch(current, patch, strict, warnings)
    if strict and not isinstance(patch, dict) and patch is not None:
        what = json_kind(patch)
        raise err_bad_request(f"error decoding patch: json: cannot unmarshal {what} into Go "
                              "value of type map[string]interface {}")
    if patch is None or (not isinstance(patch, (dict, list))):
        raise err_bad_request("Invalid JSON Patch")
    return merge_patch(current, patch)


# -- JSON merge patch (evanphx/json-patch MergePatch) ---------------------------------------------
def _prune_nulls(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _prune_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_prune_nulls(x) for x in v]
    return v


def merge_patch(doc: Any, patch: Any) -> Any:
    """RFC 7386: maps merge, ``null`` deletes, anything else (a list included) replaces."""
    if not isinstance(patch, dict):
        return _prune_nulls(patch)
    out = dict(doc) if isinstance(doc, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_patch(out[k], v)
        else:
            out[k] = _prune_nulls(v)
    return out


# -- JSON patch (RFC 6902, with the jsonpatch library) --------------------------------------------
def apply_json_patch(current: dict[str, Any], ops: Any, strict: bool, warnings: list[str]) -> Any:
    """``ops`` applied to ``current``; any failure (a failed ``test`` included) is the bare 422
    the real server answers (``NewGenericServerResponse(422, ...)``: the library's text dropped)."""
    import jsonpatch  # only JSON-patch requests need it

    if not isinstance(ops, list):
        what = json_kind(ops)
        if strict:
            raise err_bad_request(f"error decoding patch: json: cannot unmarshal {what} into Go value "
                                  "of type []handlers.jsonPatchOp")
        raise err_bad_request(f"json: cannot unmarshal {what} into Go value of type jsonpatch.Patch")
    for op in ops:
        if not isinstance(op, dict):
            raise err_bad_request(f"error decoding patch: json: cannot unmarshal {json_kind(op)} into "
                                  "Go value of type handlers.jsonPatchOp")
        if strict:
            warnings.extend(f'json patch unknown field "{k}"' for k in op
                            if k not in ("op", "path", "from", "value"))
    if len(ops) > _MAX_JSON_PATCH_OPS:
        raise APIError(failure(413, "RequestEntityTooLarge",
                               "Request entity too large: The allowed maximum operations in a JSON "
                               f"patch is {_MAX_JSON_PATCH_OPS}, got {len(ops)}"))
    try:
        return jsonpatch.JsonPatch(ops).apply(current)
    except Exception:  # jsonpatch's conflicts, failed tests, bad pointers: the server says only 422
        raise err_generic(422) from None
