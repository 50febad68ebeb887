"""Errors as the API server words them: Go-style values in messages, field errors, ``metav1.Status``.

Every failure the stand-in answers is an :class:`APIError` that carries the Status body the
real server sends for it (``apimachinery/pkg/api/errors``, ``pkg/util/validation/field``): the
same code, reason, message and details.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_OPTIMISTIC_LOCK = ("the object has been modified; please apply your changes to the latest version "
                    "and try again")


# -- Go-style rendering of values in messages ------------------------------------------------------
def goq(s: str) -> str:
    """Go's ``%q`` for the strings that appear in messages (close enough: JSON string escaping)."""
    return json.dumps(s, ensure_ascii=False)


def gojson(v: Any) -> str:
    """Go's ``json.Marshal`` of a value, HTML-escaped as Go does."""
    out = json.dumps(v, separators=(",", ":"), ensure_ascii=False)
    return out.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def gov(v: Any) -> str:
    """Go's ``%v`` of a decoded-JSON value (``map[k:v]``, ``[a b]``, ``<nil>``)."""
    if v is None:
        return "<nil>"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{gov(v[k])}" for k in sorted(v)) + "]"
    if isinstance(v, list):
        return "[" + " ".join(gov(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(int(v)) if v.is_integer() and abs(v) < 1e21 else repr(v)
    return str(v)


# -- field errors and Status bodies -------------------------------------------------------------
OMIT = object()

_FIELD_ERROR_TEXT = {
    "FieldValueRequired": "Required value", "FieldValueInvalid": "Invalid value",
    "FieldValueNotSupported": "Unsupported value", "FieldValueDuplicate": "Duplicate value",
    "FieldValueForbidden": "Forbidden", "FieldValueTooLong": "Too long",
}


@dataclass(frozen=True)
class FieldError:
    """``field.Error``: rendered exactly as ``ErrorBody`` does since 1.34 (JSON for non-scalars)."""

    type: str
    field: str
    bad: Any = OMIT
    detail: str = ""

    def body(self) -> str:
        text = _FIELD_ERROR_TEXT[self.type]
        bodyless = ("FieldValueRequired", "FieldValueForbidden", "FieldValueTooLong")
        if self.type in bodyless or self.bad is OMIT:
            s = text
        elif isinstance(self.bad, bool):
            s = f"{text}: {'true' if self.bad else 'false'}"
        elif isinstance(self.bad, (int, float)):
            s = f"{text}: {self.bad}"
        elif isinstance(self.bad, str):
            s = f"{text}: {goq(self.bad)}"
        else:
            s = f"{text}: {gojson(self.bad)}"
        return f"{s}: {self.detail}" if self.detail else s

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def required(path: str, detail: str = "") -> FieldError:
    return FieldError("FieldValueRequired", path, "", detail)


def invalid_value(path: str, bad: Any, detail: str) -> FieldError:
    return FieldError("FieldValueInvalid", path, bad, detail)


def not_supported(path: str, bad: Any, allowed: list[str]) -> FieldError:
    return FieldError("FieldValueNotSupported", path, bad,
                      "supported values: " + ", ".join(goq(a) for a in allowed) if allowed else "")


def _aggregate(errs: list[FieldError]) -> str:
    """``utilerrors.Aggregate.Error()``: duplicates (by text) removed, brackets when more than one."""
    seen: list[str] = []
    for e in errs:
        if str(e) not in seen:
            seen.append(str(e))
    return seen[0] if len(seen) == 1 else "[" + ", ".join(seen) + "]"


class APIError(Exception):
    """An error the server answers with a ``metav1.Status`` (or, for 429, plain text)."""

    def __init__(self, status: dict[str, Any], headers: dict[str, str] | None = None,
                 text: str | None = None) -> None:
        super().__init__(status.get("message", ""))
        self.status = status
        self.code = int(status["code"])
        self.headers = headers or {}
        self.text = text


def details(name: str = "", group: str = "", kind: str = "", causes: list[dict[str, str]] | None = None,
            retry_after: int = 0) -> dict[str, Any]:
    """``metav1.StatusDetails``, its empty fields left out."""
    d: dict[str, Any] = {}
    if name:
        d["name"] = name
    if group:
        d["group"] = group
    if kind:
        d["kind"] = kind
    if causes:
        d["causes"] = causes
    if retry_after:
        d["retryAfterSeconds"] = retry_after
    return d


def failure(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    """A failure ``metav1.Status`` with Go's field order and ``omitempty``s."""
    st: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
    if message:
        st["message"] = message
    if reason:
        st["reason"] = reason
    if details is not None:
        st["details"] = details
    st["code"] = code
    return st


def group_resource(resource: str, group: str) -> str:
    """``schema.GroupResource.String()``."""
    return f"{resource}.{group}" if group else resource


def err_not_found(resource: str, name: str, group: str = "") -> APIError:
    return APIError(failure(404, "NotFound", f"{group_resource(resource, group)} {goq(name)} not found",
                            details(name=name, group=group, kind=resource)))


def err_already_exists(resource: str, name: str, group: str = "") -> APIError:
    return APIError(failure(409, "AlreadyExists",
                            f"{group_resource(resource, group)} {goq(name)} already exists",
                            details(name=name, group=group, kind=resource)))


def err_conflict(resource: str, name: str, why: str = _OPTIMISTIC_LOCK, group: str = "") -> APIError:
    return APIError(failure(409, "Conflict", f"Operation cannot be fulfilled on "
                                             f"{group_resource(resource, group)} {goq(name)}: {why}",
                            details(name=name, group=group, kind=resource)))


def err_bad_request(message: str) -> APIError:
    return APIError(failure(400, "BadRequest", message))


def err_invalid(kind: str, name: str, errs: list[FieldError], group: str = "") -> APIError:
    """``errors.NewInvalid``: every error is a cause; the message lists each distinct one once."""
    qualified = f"{kind}.{group}" if group else kind
    causes = [{"reason": e.type, "message": e.body(), "field": e.field} for e in errs]
    message = f"{qualified} {goq(name)} is invalid"
    if errs:
        message += ": " + _aggregate(errs)
    return APIError(failure(422, "Invalid", message, details(name=name, group=group, kind=kind,
                                                                causes=causes)))


def err_generic(code: int, server_message: str = "") -> APIError:
    """``errors.NewGenericServerResponse(code, "", {}, "", msg, 0, false)``: what go-restful and a
    failed JSON patch produce (``details`` present but empty)."""
    reason, message = {
        400: ("BadRequest", "the server rejected our request for an unknown reason"),
        401: ("Unauthorized", "the server has asked for the client to provide credentials"),
        403: ("Forbidden", server_message),
        404: ("NotFound", "the server could not find the requested resource"),
        405: ("MethodNotAllowed", "the server does not allow this method on the requested resource"),
        409: ("Conflict", "the server reported a conflict"),
        415: ("UnsupportedMediaType", server_message),
        422: ("Invalid", "the server rejected our request due to an error in our request"),
        429: ("TooManyRequests", "the server has received too many requests and has asked us to try "
                                 "again later"),
        503: ("ServiceUnavailable", "the server is currently unable to handle the request"),
        504: ("Timeout", "the server was unable to return a response in the time allotted, but may "
                         "still be processing the request"),
    }.get(code, ("", f"the server responded with the status code {code} but did not return more "
                     "information"))
    if code >= 500 and code not in (503, 504):
        reason, message = "InternalError", f"an error on the server ({goq(server_message)}) has prevented " \
                                           "the request from succeeding"
    return APIError(failure(code, reason, message, {}))


def err_internal(message: str) -> APIError:
    """An error that is not an ``APIStatus`` (``ErrorToAPIStatus``: 500, reason empty)."""
    return APIError(failure(500, "", message))


def err_unsupported_media(accepted: tuple[str, ...]) -> APIError:
    return APIError(failure(415, "UnsupportedMediaType",
                            "the body of the request was in an unknown format - accepted media types "
                            "include: " + ", ".join(accepted)))


def err_unauthorized() -> APIError:
    return APIError(failure(401, "Unauthorized", "Unauthorized"))

