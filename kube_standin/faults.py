"""Failures a test injects: the answers an unwell control plane gives, and answers held back.

:meth:`Faults.fail` answers matching requests with an error before authentication, without
processing them; :meth:`Faults.delay` lets them be processed at once and holds the answer
(see :meth:`kube_standin.StandInAPIServer.fail` and ``.delay``).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from kube_standin.auth import forbidden_error
from kube_standin.routes import Route, verb
from kube_standin.status import (
    APIError,
    details,
    err_conflict,
    err_generic,
    err_not_found,
    err_unauthorized,
    failure,
)


@dataclass
class Rule:
    """The next ``times`` requests with ``method`` (``*``: any) whose path matches ``pattern``."""

    method: str
    pattern: re.Pattern[str]
    times: int
    status: int = 0
    message: str | None = None
    seconds: float = 0.0

    def matches(self, method: str, path: str) -> bool:
        return self.times > 0 and self.method in ("*", method) and self.pattern.search(path) is not None


class Faults:
    """The pending fail and delay rules, each used up by the requests it matches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fail: list[Rule] = []
        self._delay: list[Rule] = []

    def fail(self, method: str, path_regex: str, status: int, *, times: int,
             message: str | None) -> None:
        with self._lock:
            self._fail.append(Rule(method.upper(), re.compile(path_regex), times, status=status,
                                   message=message))

    def delay(self, method: str, path_regex: str, seconds: float, *, times: int) -> None:
        with self._lock:
            self._delay.append(Rule(method.upper(), re.compile(path_regex), times, seconds=seconds))

    def take(self, method: str, path: str) -> tuple[Rule | None, float]:
        """The fail rule a request meets (None: none) and how long its answer is held; each rule
        met counts the request."""
        delay = 0.0
        with self._lock:
            rule = next((r for r in self._fail if r.matches(method, path)), None)
            if rule is not None:
                rule.times -= 1
            delay_rule = next((r for r in self._delay if r.matches(method, path)), None)
            if delay_rule is not None:
                delay_rule.times -= 1
                delay = delay_rule.seconds
            self._fail = [r for r in self._fail if r.times > 0]
            self._delay = [r for r in self._delay if r.times > 0]
        return rule, delay


def injected_error(rule: Rule, method: str, route: Route | None, user: str) -> APIError:
    """The answer the real server gives with ``rule.status`` (``rule.message`` replacing its
    message); a 429 is its plain-text answer with ``Retry-After: 1``."""
    code, message = rule.status, rule.message
    resource, name, group = (route.resource, route.name, route.group) if route else ("", "", "")
    err: APIError
    if code == 401:
        err = err_unauthorized()
    elif code == 403 and route is not None:
        err = forbidden_error(verb(method, route, {}), route, user)
    elif code == 404 and route is not None and name:
        err = err_not_found(resource, name, group)
    elif code == 409 and route is not None and name:
        err = err_conflict(resource, name, group=group)
    elif code == 429:
        text = (message or "Too many requests, please try again later.") + "\n"
        return APIError(failure(429, "TooManyRequests", text.strip()), {"Retry-After": "1"}, text=text)
    elif code == 500:
        why = message or "injected failure"
        return APIError(failure(500, "InternalError", f"Internal error occurred: {why}",
                                details(causes=[{"message": why}])))
    elif code == 503:
        return APIError(failure(503, "ServiceUnavailable", message or
                                "the server is currently unable to handle the request"))
    elif code == 504:
        err = APIError(failure(504, "Timeout", "Timeout: request did not complete within requested "
                                               "timeout - context deadline exceeded", {}))
    else:
        err = err_generic(code, message or "")
    if message:
        err.status["message"] = message
    return err
