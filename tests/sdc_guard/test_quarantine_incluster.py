"""In-cluster auth: the pod's service account (token and CA files, the KUBERNETES_SERVICE_*
variables) through the official client over HTTPS to the loopback stand-in, as in a pod."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kube_standin import StandInAPIServer
from sdc_guard import Detection
from sdc_guard.remediation import KubeQuarantine
from sdc_guard.remediation.api import KubeError, NodeAPI, load_client
from sdc_guard.remediation.evidence import TAINT_KEY
from sdc_guard.topology import RankPlace, Topology

Pod = tuple[StandInAPIServer, Path]
"""The stand-in serving HTTPS, and the service account's token file."""


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, its own CA (as a cluster's serving certificate chains to the
    ``ca.crt`` mounted in every pod), and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-stand-in")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    crt, pem = directory / "ca.crt", directory / "server.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    return crt, pem


@pytest.fixture
def pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pod]:
    """A pod's view: the service account's token and CA files, the service variables."""
    from kubernetes.config import incluster_config

    crt, key = _self_signed(tmp_path)
    token = tmp_path / "token"
    token.write_text("sa-token")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(crt))
    with StandInAPIServer(token="sa-token", tls=(crt, key)) as srv:
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(srv.port))
        srv.add_node("n0")
        srv.add_node("n1")
        yield srv, token


def test_the_service_account_reaches_the_server_over_https(pod: Pod) -> None:
    srv, _ = pod
    api = NodeAPI(load_client(None), request_timeout_s=2.0)
    assert sorted(n["metadata"]["name"] for n in api.list()) == ["n0", "n1"]
    last = srv.requests[-1]
    assert (last.method, last.path, last.status) == ("GET", "/api/v1/nodes", 200)


def test_a_pod_cordons_the_suspects_node_with_its_service_account(pod: Pod) -> None:
    srv, _ = pod
    topo = Topology((RankPlace(0, "h0", "n0", pod="p0", namespace="default"),
                     RankPlace(1, "h1", "n1", pod="p1", namespace="default")))
    q = KubeQuarantine(kubeconfig=None, dry_run=False, job="job-a", max_nodes=1,
                       max_fraction=1.0, backoff_s=0.01, request_timeout_s=2.0, deadline_s=10.0)
    q.bind(topology=topo, rank=0)
    q.act(Detection("weights", 3, (1,), "fingerprints differ", {},
                    suspect_nodes=topo.nodes_of((1,))))
    assert q.drain(10.0)
    assert [a.action for a in q.actions] == ["cordon"], [a.to_json() for a in q.actions]
    node = srv.node("n1")
    assert node["spec"]["unschedulable"] is True
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT_KEY]
    assert not srv.node("n0")["spec"].get("unschedulable")


def test_a_rotated_or_wrong_token_is_refused_by_name(pod: Pod) -> None:
    _, token = pod
    token.write_text("stale")
    with pytest.raises(KubeError, match=r"401 Unauthorized .* service account token"):
        NodeAPI(load_client(None), request_timeout_s=2.0, retries=0).get("n0")


def test_outside_a_pod_the_error_says_to_pass_a_kubeconfig(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeError, match="kubeconfig"):
        load_client(None)
