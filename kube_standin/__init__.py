"""A Kubernetes API server stand-in on loopback, for tests and for the fault-injection campaign.

Test support, not part of the library: it lives in the clone beside the harness (``scenarios``
starts one per campaign trial that quarantines) and is not in the ``sdc-guard`` wheel. Import it
as ``from kube_standin import StandInAPIServer``.

Why it exists: the node quarantine (``sdc_guard.remediation``) talks to kube-apiserver through the
official ``kubernetes`` client. Mocking the client would only test our *beliefs* about the server;
a real cluster (kind, k3s) is too heavy to start per test or per campaign trial. This package serves
the small part of the core API the quarantine uses, over real HTTP on 127.0.0.1, with the real
server's semantics and wire format, so the official client (and anything else that speaks HTTP)
can be pointed at it through a kubeconfig it writes, and so tests can inject the failures a real
control plane produces (403, 409, 500, 503, slow answers, the server going away).

Served (everything else answers a 404 Status; a known path with a verb not served answers 405):

* ``GET /api/v1/nodes`` (``labelSelector``: ``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``,
  ``>``, ``<``; ``fieldSelector`` on ``metadata.name`` and ``spec.unschedulable``; ``limit`` and
  ``continue``), ``GET``/``PATCH``/``PUT`` on ``/api/v1/nodes/{name}`` and ``.../{name}/status``.
* ``POST``/``GET`` ``/api/v1/namespaces/{ns}/events``, ``GET /api/v1/events``, ``GET .../events/{name}``,
  ``POST``/``GET`` ``/apis/events.k8s.io/v1/namespaces/{ns}/events`` (stored once, as core/v1 Events).
* ``GET /apis/coordination.k8s.io/v1/leases``, ``GET``/``POST`` ``.../namespaces/{ns}/leases``,
  ``GET``/``PUT``/``PATCH``/``DELETE`` ``.../namespaces/{ns}/leases/{name}`` (:mod:`~kube_standin.leases`:
  create 409 ``AlreadyExists`` on a taken name, update 409 ``Conflict`` on a stale resourceVersion and
  422 without one, get 404).
* ``GET /version``.

What is reproduced, and where it was read (the Go sources of kubernetes/apiserver, apimachinery,
api and kubernetes, 2026 heads, i.e. Kubernetes 1.37, the release the ``kubernetes`` v37 client targets):

* PATCH (``handlers/patch.go``): the accepted types are checked first (415 ``UnsupportedMediaType``,
  message ``the body of the request was in an unknown format - accepted media types include: ...``);
  then the options (``dryRun`` other than ``All`` and bad ``fieldValidation``/``fieldManager`` are a
  422 ``PatchOptions.meta.k8s.io "" is invalid``, not a 400); then the body must be JSON (400
  ``invalid JSON patch``). JSON patch (RFC 6902, with the ``jsonpatch`` library) that fails, a
  failed ``test`` included, is a 422 ``Invalid`` whose message is only ``the server rejected our
  request due to an error in our request`` (the real server drops the library's text:
  ``NewGenericServerResponse(422, ..., isUnexpectedResponse=false)``). JSON merge patch is RFC 7386
  as evanphx/json-patch does it: maps merge, ``null`` deletes, every list (``spec.taints``
  included) is replaced whole, so a client that sends only its own taint drops everyone else's.
* Strategic merge patch is not served: ``application/strategic-merge-patch+json`` is answered 415,
  the answer the real server gives it for a type without a strategic-merge schema (a custom
  resource), listing the two types served. The product sends only JSON patches
  (``sdc_guard.remediation.api``: a list body, which every ``kubernetes`` client version sends as
  ``application/json-patch+json``), so a port of ``strategicpatch`` would test nothing the product
  does; a change that made it send one fails here at once instead of passing against a port
  checked against no upstream fixtures.
* The result is decoded into the typed object, as the server does: unknown fields are dropped (a
  ``Warning: 299`` header per field; ``fieldValidation=Strict`` makes it a 422), empty optional
  fields disappear (``omitempty``: patching ``spec.taints`` to ``[]`` leaves no ``taints`` key),
  a wrong type is a 422 ``patch: Invalid value``. A PATCH/PUT of the node never changes its status,
  one of ``/status`` never changes its spec (``nodeStrategy.PrepareForUpdate``).
* Then the name must match the URL (400), a ``metadata.resourceVersion`` in the result must equal the
  stored one (409 ``Conflict``: ``Operation cannot be fulfilled on nodes "n1": the object has been
  modified; please apply your changes to the latest version and try again``), ``uid`` may not change
  (422 ``field is immutable``), ``creationTimestamp`` changes are silently reverted, and the node is
  validated: taint key/value/effect, duplicate (key, effect) pairs (reported, as the real server
  does, under ``metadata.taints[i]``), label and annotation keys and values, the 262144-byte total
  for annotations (``metadata.annotations: Too long: may not be more than 262144 bytes``, the wording
  since 1.32; 1.31 and older said ``must have at most 262144 bytes``), ``spec.providerID`` and
  ``spec.podCIDRs`` immutability. A write that changes nothing keeps the resourceVersion (etcd is not
  written). ``resourceVersion`` is one cluster-wide counter, a decimal string.
* ``dryRun=All`` runs all of it and answers the would-be object (with the stored resourceVersion for
  an update, none for a create) and stores nothing.
* Events (core/v1): the namespace must exist (404 ``namespaces "x" not found``; ``default``,
  ``kube-system``, ``kube-public``, ``kube-node-lease`` exist, see :meth:`StandInAPIServer.add_namespace`);
  the legacy event validation applies: an event whose ``involvedObject`` has no namespace (a Node)
  may only be created in ``default`` (or with no namespace); ``metadata.name`` or ``generateName``
  is required; ``generateName`` gets 5 random characters. There is no check that ``involvedObject``
  is present: the real server has none either. ``events.k8s.io/v1`` creations get that API's strict
  validation (``eventTime``, ``reportingController``, ``action``, ...). ``eventTime`` is a MicroTime:
  exactly six fraction digits, or a 400 (a Python ``datetime`` with no microseconds is refused).
* HTTPS when given a certificate and key (``tls=``), as a pod's in-cluster client reaches the
  real server (``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, verified against the
  service account's ``ca.crt``); plain HTTP otherwise.
* Authentication by bearer token (401 ``Unauthorized``); RBAC denials with the real message
  (``nodes "n1" is forbidden: User "..." cannot patch resource "nodes" in API group "" at the cluster
  scope``); Status bodies byte-compatible with ``metav1.Status`` (``details`` only where the server
  sets it; ``kind`` in details is the resource for NotFound/Conflict/Forbidden and the Kind for
  Invalid). :meth:`StandInAPIServer.fail` answers before authentication and without processing;
  :meth:`StandInAPIServer.delay` processes at once and holds the answer.

Not reproduced: watch, strategic merge patch (above), server-side apply
(``application/apply-patch+yaml`` is answered 415, and the 415 message lists only the two types
served, as a server with server-side apply disabled would), protobuf/CBOR, ``managedFields``,
admission webhooks, quantity canonicalisation (``"1000m"`` stays as sent), consistent snapshots
for paginated lists, and node creation through the API (nodes are made with
:meth:`StandInAPIServer.add_node`, as a kubelet would register them).

Where each part lives: :mod:`~kube_standin.server` (the server, its lifecycle and records),
:mod:`~kube_standin.transport` (HTTP, TLS, connections), :mod:`~kube_standin.handlers` (what each
request does), :mod:`~kube_standin.store` (objects and resourceVersions),
:mod:`~kube_standin.leases` (Leases), :mod:`~kube_standin.patch` (JSON and merge patches),
:mod:`~kube_standin.schema` (decoding into the typed objects),
:mod:`~kube_standin.validation`, :mod:`~kube_standin.selectors`, :mod:`~kube_standin.auth` (tokens
and RBAC), :mod:`~kube_standin.faults` (injected failures), :mod:`~kube_standin.status` (errors
as the server words them).
"""

from __future__ import annotations

from kube_standin.auth import DEFAULT_USER
from kube_standin.schema import KUBE_VERSION
from kube_standin.server import RequestRecord, StandInAPIServer

__all__ = ["DEFAULT_USER", "KUBE_VERSION", "RequestRecord", "StandInAPIServer"]
