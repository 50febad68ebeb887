"""What a request's path names: the endpoint that serves it and its RBAC attributes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote


@dataclass(frozen=True)
class Route:
    """What a path names: the RBAC attributes and which handler serves it."""

    endpoint: str
    resource: str
    group: str = ""
    namespace: str = ""
    name: str = ""
    subresource: str = ""

    @property
    def rbac_resource(self) -> str:
        """The resource as RBAC rules name it (``nodes/status`` for the subresource)."""
        return self.resource + (f"/{self.subresource}" if self.subresource else "")


_ROUTES: tuple[tuple[re.Pattern[str], str, str, str, str], ...] = tuple(
    (re.compile(p), endpoint, resource, group, sub) for p, endpoint, resource, group, sub in (
        (r"^/api/v1/nodes$", "nodes", "nodes", "", ""),
        (r"^/api/v1/nodes/(?P<name>[^/]+)$", "node", "nodes", "", ""),
        (r"^/api/v1/nodes/(?P<name>[^/]+)/status$", "node", "nodes", "", "status"),
        (r"^/api/v1/events$", "events", "events", "", ""),
        (r"^/api/v1/namespaces/(?P<namespace>[^/]+)/events$", "events", "events", "", ""),
        (r"^/api/v1/namespaces/(?P<namespace>[^/]+)/events/(?P<name>[^/]+)$", "event", "events", "", ""),
        (r"^/apis/events\.k8s\.io/v1/events$", "events", "events", "events.k8s.io", ""),
        (r"^/apis/events\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/events$", "events", "events",
         "events.k8s.io", ""),
        (r"^/apis/events\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/events/(?P<name>[^/]+)$", "event",
         "events", "events.k8s.io", ""),
        (r"^/apis/coordination\.k8s\.io/v1/leases$", "leases", "leases", "coordination.k8s.io", ""),
        (r"^/apis/coordination\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/leases$", "leases", "leases",
         "coordination.k8s.io", ""),
        (r"^/apis/coordination\.k8s\.io/v1/namespaces/(?P<namespace>[^/]+)/leases/(?P<name>[^/]+)$",
         "lease", "leases", "coordination.k8s.io", ""),
    ))
ALLOWED_METHODS = {"nodes": {"GET"}, "node": {"GET", "PATCH", "PUT"}, "events": {"GET", "POST"},
                   "event": {"GET"}, "leases": {"GET", "POST"},
                   "lease": {"GET", "PUT", "PATCH", "DELETE"}}
"""The methods each endpoint serves; another method on a known path is a 405."""


def route(path: str) -> Route | None:
    """The route ``path`` (without its query) names, or None for a path not served."""
    for pattern, endpoint, resource, group, sub in _ROUTES:
        m = pattern.match(path)
        if m:
            g = {k: unquote(v) for k, v in m.groupdict().items()}
            return Route(endpoint, resource, group, g.get("namespace", ""), g.get("name", ""), sub)
    return None


def verb(method: str, route: Route, query: dict[str, list[str]]) -> str:
    """The RBAC verb of a request (``list``/``watch`` for a collection GET, ``get`` for one)."""
    if method == "GET":
        if route.endpoint in ("nodes", "events", "leases"):
            return "watch" if query.get("watch", [""])[0] in ("true", "1") else "list"
        return "get"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method,
                                                                                           method.lower())
