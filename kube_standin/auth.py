"""Who a request is and what it may do: bearer-token authentication (401) and RBAC denials (403)."""

from __future__ import annotations

import threading
from typing import Any

from kube_standin.routes import Route
from kube_standin.status import APIError, details, err_unauthorized, failure, goq, group_resource

DEFAULT_USER = "system:serviceaccount:default:sdc-guard"
"""Who the bearer token authenticates as, in RBAC denials."""

ANONYMOUS = "system:anonymous"


class Access:
    """The token a request must carry, whom it authenticates as, and the denied (verb, resource)
    pairs; everything not denied is allowed (see :class:`kube_standin.StandInAPIServer`)."""

    def __init__(self, token: str | None, user: str, anonymous: bool) -> None:
        self.token = token
        self.user = user
        self.anonymous = anonymous
        self._lock = threading.Lock()
        self._forbidden: set[tuple[str, str]] = set()

    def forbid(self, verb: str, resource: str) -> None:
        with self._lock:
            self._forbidden.add((verb, resource))

    def allow(self, verb: str, resource: str) -> None:
        with self._lock:
            self._forbidden.discard((verb, resource))

    def authenticate(self, headers: Any) -> str:
        """The user a request's ``Authorization`` header names; a 401 when it names none."""
        if self.token is None:
            return self.user
        auth = headers.get("Authorization")
        if auth is None and self.anonymous:
            return ANONYMOUS
        parts = (auth or "").split(" ", 2)
        if len(parts) < 2 or parts[0].lower() != "bearer" or parts[1] != self.token:
            raise err_unauthorized()
        return self.user

    def authorize(self, verb: str, route: Route, user: str) -> None:
        """A 403 with the RBAC message when ``user`` may not ``verb`` the route's resource (the
        anonymous user may do nothing)."""
        resource = route.rbac_resource
        with self._lock:
            denied = any((v in (verb, "*")) and (r in (resource, "*")) for v, r in self._forbidden)
        if denied or user == ANONYMOUS:
            raise forbidden_error(verb, route, user)


def forbidden_error(verb: str, route: Route, user: str) -> APIError:
    """The 403 the RBAC authorizer answers (``nodes "n1" is forbidden: User ... cannot ...``)."""
    where = f'in the namespace "{route.namespace}"' if route.namespace else "at the cluster scope"
    why = (f'User "{user}" cannot {verb} resource "{route.rbac_resource}" in API group '
           f'"{route.group}" {where}')
    gr = group_resource(route.resource, route.group)
    message = f"{gr} {goq(route.name)} is forbidden: {why}" if route.name else \
        f"{gr} is forbidden: {why}"
    return APIError(failure(403, "Forbidden", message,
                            details(name=route.name, group=route.group, kind=route.resource)))
