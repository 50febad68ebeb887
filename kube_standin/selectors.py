"""Label and field selectors of list requests (``labels.Parse``, ``fields.ParseSelector``)."""

from __future__ import annotations

import re
from collections.abc import Callable

from kube_standin.status import err_bad_request, goq
from kube_standin.validation import label_key_errors, label_value_errors


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


_REQ_SET = re.compile(r"^\s*([^\s!=<>(),]+)\s+(in|notin)\s*\(([^()]*)\)\s*$")
_REQ_OP = re.compile(r"^\s*([^\s!=<>(),]+)\s*(==|!=|=|>|<)\s*([^\s!=<>(),]*)\s*$")
_REQ_EXISTS = re.compile(r"^\s*(!?)\s*([^\s!=<>(),]+)\s*$")


def parse_label_selector(text: str) -> list[tuple[str, str, list[str]]]:
    """``labels.Parse``: a list of (key, operator, values); a 400 ``APIError`` on bad syntax."""
    reqs: list[tuple[str, str, list[str]]] = []
    if not text.strip():
        return reqs
    for part in _split_top(text):
        if m := _REQ_SET.match(part):
            key, op, values = m.group(1), m.group(2), [v.strip() for v in m.group(3).split(",")]
            values = [v for v in values if v] if op == "notin" else values
        elif m := _REQ_OP.match(part):
            key, op, values = m.group(1), m.group(2), [m.group(3)]
            if op in (">", "<") and not re.fullmatch(r"-?\d+", values[0]):
                raise err_bad_request("unable to parse requirement: for 'Gt', 'Lt' operators, the value "
                                      "must be an integer")
        elif m := _REQ_EXISTS.match(part):
            key, op, values = m.group(2), "!" if m.group(1) else "exists", []
        else:
            raise err_bad_request(f"unable to parse requirement: found '{part.strip()}', expected: "
                                  "',' or 'end of string'")
        if errs := label_key_errors(key):
            raise err_bad_request(f"unable to parse requirement: <nil>: Invalid value: {goq(key)}: "
                                  + "; ".join(errs))
        for v in values if op not in (">", "<") else []:
            if errs := label_value_errors(v):
                raise err_bad_request(f"unable to parse requirement: <nil>: Invalid value: {goq(v)}: "
                                      + "; ".join(errs))
        reqs.append((key, op, values))
    return reqs


def labels_match(labels: dict[str, str], reqs: list[tuple[str, str, list[str]]]) -> bool:
    for key, op, values in reqs:
        has, val = key in labels, labels.get(key, "")
        if op in ("exists", "!"):
            ok = has == (op == "exists")
        elif op in ("=", "=="):
            ok = has and val == values[0]
        elif op == "!=":
            ok = not has or val != values[0]
        elif op in ("in", "notin"):
            ok = (has and val in values) if op == "in" else (not has or val not in values)
        else:  # > and <
            try:
                ok = has and (int(val) > int(values[0]) if op == ">" else int(val) < int(values[0]))
            except ValueError:
                ok = False
        if not ok:
            return False
    return True


def parse_field_selector(text: str, supported: Callable[[str], bool]) -> list[tuple[str, str, str]]:
    reqs: list[tuple[str, str, str]] = []
    if not text.strip():
        return reqs
    for part in re.split(r"(?<!\\),", text):
        m = re.match(r"^(.*?)(==|!=|=)(.*)$", part)
        if not m:
            raise err_bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        key, op, value = m.group(1).strip(), m.group(2), re.sub(r"\\(.)", r"\1", m.group(3))
        if not supported(key):
            raise err_bad_request(f"field label not supported: {key}")
        reqs.append((key, "!=" if op == "!=" else "=", value))
    return reqs


def fields_match(fields: dict[str, str], reqs: list[tuple[str, str, str]]) -> bool:
    return all((fields.get(k, "") == v) == (op == "=") for k, op, v in reqs)

