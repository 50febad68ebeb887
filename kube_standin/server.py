"""The stand-in server: a :class:`~kube_standin.store.Store` served over HTTP(S) on 127.0.0.1.

What it reproduces, and what not, is in the package docstring (:mod:`kube_standin`).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from kube_standin.auth import DEFAULT_USER, Access
from kube_standin.faults import Faults, injected_error
from kube_standin.handlers import error_response, serve
from kube_standin.routes import route
from kube_standin.status import APIError, failure
from kube_standin.store import Store
from kube_standin.transport import MAX_BODY, HTTPServer, Response


@dataclass(frozen=True)
class RequestRecord:
    """One request, recorded when its answer is decided (before any :meth:`StandInAPIServer.delay`).

    ``status`` is the code answered (or that would have been, had :meth:`StandInAPIServer.stop` not
    dropped a delayed answer); ``query`` keeps the first value of each parameter; ``dry_run`` is
    whether ``dryRun`` was sent; ``time`` is ``time.time()`` at arrival; ``body`` is the parsed JSON
    body (``None`` when there was none or it was not JSON).
    """

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    status: int
    dry_run: bool
    time: float
    body: Any = None
    user_agent: str = ""


_Server = TypeVar("_Server", bound="StandInAPIServer")


class StandInAPIServer(Store):
    """A kube-apiserver stand-in on 127.0.0.1 (see :mod:`kube_standin` for what it reproduces).

    ``token``: the bearer token a request must carry (``None``: no authentication, every request is
    ``user``). ``tls``: ``(certificate file, key file)`` to serve HTTPS (``None``: HTTP). ``user``:
    whom the token authenticates as, in RBAC denials. ``anonymous``: a request
    without any token is ``system:anonymous`` (so a 403, as with ``--anonymous-auth=true``) instead of
    a 401. The socket is bound at construction, so ``url`` and :meth:`write_kubeconfig` work before
    :meth:`start`; after :meth:`stop`, :meth:`start` binds the same port again (a restarted server,
    same store).

    The cluster is set up and read through the store's methods (:meth:`add_node`, :meth:`node`,
    :meth:`nodes`, :meth:`bump`, :meth:`add_namespace`, :attr:`events`); the requests it answered
    are in :attr:`requests`; :meth:`fail`, :meth:`delay` and :meth:`forbid` inject failures.
    """

    def __init__(self, token: str | None = "test-token", *, user: str = DEFAULT_USER,
                 anonymous: bool = False, tls: tuple[str | Path, str | Path] | None = None) -> None:
        super().__init__()
        self.tls = None if tls is None else (str(tls[0]), str(tls[1]))
        self._access = Access(token, user, anonymous)
        self._faults = Faults()
        self._records_lock = threading.Lock()
        self._records: list[RequestRecord] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._httpd: HTTPServer | None = HTTPServer(("127.0.0.1", 0), self._answer, self._stopping,
                                                    self.tls)
        self.port: int = self._httpd.server_address[1]

    @property
    def token(self) -> str | None:
        """The bearer token a request must carry (None: no authentication)."""
        return self._access.token

    @property
    def user(self) -> str:
        """Whom the token authenticates as."""
        return self._access.user

    @property
    def anonymous(self) -> bool:
        """Whether a request without a token is ``system:anonymous`` (a 403) rather than a 401."""
        return self._access.anonymous

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with ``tls``)."""
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self) -> StandInAPIServer:
        """Serve on a daemon thread (rebinding the same port if the server was stopped)."""
        if self._thread is not None:
            return self
        if self._httpd is None:
            self._httpd = HTTPServer(("127.0.0.1", self.port), self._answer, self._stopping, self.tls)
        self._stopping.clear()
        httpd = self._httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"kubeapi-stand-in:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop like a killed process: close the listening socket and every open connection, so the
        next client call gets connection refused; answers still held by :meth:`delay` are dropped."""
        self._stopping.set()
        httpd, thread = self._httpd, self._thread
        self._httpd, self._thread = None, None
        if httpd is None:
            return
        if thread is not None:
            httpd.shutdown()
        httpd.server_close()
        httpd.cut_connections()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self: _Server) -> _Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        """Write a kubeconfig (cluster ``stand-in`` at :attr:`url`, the token, a current context) that
        ``kubernetes.config.load_kube_config``/``new_client_from_config`` load. JSON is valid YAML:
        every value is written JSON-quoted."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        user = f"    token: {json.dumps(self.token)}\n" if self.token is not None else "    {}\n"
        p.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: stand-in\n  cluster:\n    server: {json.dumps(self.url)}\n"
            + (f"    certificate-authority: {json.dumps(self.tls[0])}\n" if self.tls else "") +
            "users:\n- name: sdc-guard\n  user:\n" + user +
            "contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: sdc-guard\n"
            f"    namespace: {json.dumps(namespace)}\n"
            "current-context: stand-in\npreferences: {}\n")
        return p

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request answered so far, in arrival order of their answers."""
        with self._records_lock:
            return list(self._records)

    def clear_requests(self) -> None:
        """Forget the recorded requests."""
        with self._records_lock:
            self._records.clear()

    # -- fault injection -------------------------------------------------------------------------------
    def fail(self, method: str, path_regex: str, status: int, *, times: int = 1,
             message: str | None = None) -> None:
        """The next ``times`` requests whose method is ``method`` (``"*"``: any) and whose path (no
        query) matches ``path_regex`` (``re.search``) are answered ``status`` with the Status body the
        real server sends for that code (``message`` replaces its message), before authentication and
        without being processed: nothing is stored. A 429 is the real plain-text answer with
        ``Retry-After: 1``."""
        self._faults.fail(method, path_regex, status, times=times, message=message)

    def delay(self, method: str, path_regex: str, seconds: float, *, times: int = 1) -> None:
        """The next ``times`` matching requests are processed (and any write committed) at once, and
        answered only after ``seconds``: what a client with a shorter read timeout sees is a timeout
        on a request that did take effect. :meth:`stop` drops the held answers."""
        self._faults.delay(method, path_regex, seconds, times=times)

    def forbid(self, verb: str, resource: str) -> None:
        """RBAC: deny ``verb`` (get, list, watch, create, update, patch, delete; ``*``) on ``resource``
        (``nodes``, ``nodes/status``, ``events``, ``leases``; ``*``). Everything not forbidden is allowed."""
        self._access.forbid(verb, resource)

    def allow(self, verb: str, resource: str) -> None:
        """Undo :meth:`forbid`."""
        self._access.allow(verb, resource)

    # -- request handling ------------------------------------------------------------------------------
    def _answer(self, method: str, raw_path: str, headers: Any, body: bytes,
                oversized: bool) -> tuple[Response, float]:
        """A request's answer and how long to hold it; every request is recorded."""
        arrived = time.time()
        split = urlsplit(raw_path)
        path = split.path
        multi = parse_qs(split.query, keep_blank_values=True)
        query = {k: v[0] for k, v in multi.items()}
        content_type = headers.get("Content-Type") or ""
        try:
            parsed_body = json.loads(body) if body else None
        except ValueError:
            parsed_body = None
        rule, delay = self._faults.take(method, path)
        where = route(path)
        try:
            if rule is not None:
                raise injected_error(rule, method, where, self.user)
            if oversized:
                raise APIError(failure(413, "RequestEntityTooLarge",
                                       f"Request entity too large: limit is {MAX_BODY}"))
            resp = serve(self, self._access, method, path, where, multi, headers, body)
        except APIError as e:
            resp = error_response(e)
        except Exception as e:  # a bug here must reach the test as a 500, not hang the client
            resp = error_response(APIError(failure(500, "InternalError",
                                                   f"Internal error occurred: stand-in: {e!r}")))
        with self._records_lock:
            self._records.append(RequestRecord(
                method=method, path=path, query=query, content_type=content_type, status=resp.code,
                dry_run="dryRun" in multi, time=arrived, body=parsed_body,
                user_agent=headers.get("User-Agent") or ""))
        return resp, delay
