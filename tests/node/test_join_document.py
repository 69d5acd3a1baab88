"""Issue 21 (Low): the join document in a burst node's user data holds its ticket. The user data writes it for
root only (umask 077), and the node join deletes it once the ticket is redeemed; a rerun (a reboot) still works
from the saved answer, or renews an expired certificate with the kubelet key (Medium 7)."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from models.join import CertRenewal
from models.join import CertRenewalAnswer
from models.join import JoinAnswer
from models.join import JoinRedeem
from models.join import render_user_data
from models.labels import Taint
from node.join import JoinError
from node.join import NodeFiles
from node.join import join
from node.join import kubelet_key
from node.join import main_join
from node.join import renew


def test_l5_the_user_data_writes_the_join_document_for_root_only(tmp_path: Path) -> None:
    user_data = render_user_data(gateway_url="https://gw.example:8443", ticket="the-ticket", node_name="burst-1",
                                 labels={}, taints=[Taint(key="gpu.kubeon.io/burst")])
    etc, units, booted = tmp_path / "etc-kubeon", tmp_path / "units", tmp_path / "run-systemd"
    units.mkdir()
    booted.mkdir()  # systemd is the init
    script = tmp_path / "user-data.sh"
    script.write_text(user_data.replace("/etc/kubeon", str(etc)).replace("/etc/systemd/system", str(units))
                      .replace("/run/systemd/system", str(booted)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "kubeon-gpu"  # what the node join sees when it starts
    stub.write_text(f"#!/bin/sh\nstat -c '%a' {etc} {etc}/join.json > {tmp_path}/modes\n")
    systemctl = bin_dir / "systemctl"
    systemctl.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/systemctl\n")
    for command in (stub, systemctl):
        command.chmod(0o755)
    done = subprocess.run(["bash", "-c", f"umask 022; exec bash {script}"], capture_output=True, text=True,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "modes").read_text().split() == ["700", "600"]
    # The certificate renewal timer (burst nodes have no rotation of their own), enabled before the join.
    assert "ExecStart=/usr/bin/env kubeon-gpu node renew" in (units / "kubeon-renew.service").read_text()
    assert "OnUnitActiveSec=10min" in (units / "kubeon-renew.timer").read_text()
    assert (tmp_path / "systemctl").read_text().splitlines() == ["daemon-reload", "enable --now kubeon-renew.timer"]


def _answer(node: str, *, key: ec.EllipticCurvePrivateKey | None = None,
            valid: dt.timedelta = dt.timedelta(hours=1)) -> JoinAnswer:
    """A join answer whose certificate is for ``key`` (a new one by default), valid from ``valid`` before its end
    (negative: expired)."""
    key = key or ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{node}")])
    now = dt.datetime.now(dt.UTC)
    start = min(now, now + valid) - dt.timedelta(hours=1)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(now + valid)
            .sign(key, hashes.SHA256()))
    from cryptography.hazmat.primitives import serialization

    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    return JoinAnswer(node_name=node, certificate=pem, ca_bundle=pem, api_server="https://127.0.0.1:6443",
                      pod_cidr="10.245.0.0/24", labels={}, taints=[])


def test_l5_the_node_join_deletes_the_join_document_once_redeemed_and_a_rerun_still_works(tmp_path: Path) -> None:
    config = tmp_path / "join.json"
    user_data = render_user_data(gateway_url="https://gw.example:8443", ticket="the-ticket", node_name="burst-1",
                                 labels={}, taints=[])
    config.write_text(user_data.split("<<'KUBEON_JOIN'\n", 1)[1].split("\nKUBEON_JOIN", 1)[0])
    redeemed: list[JoinRedeem] = []

    def redeem(request: JoinRedeem) -> JoinAnswer:
        redeemed.append(request)
        return _answer("burst-1")

    state = tmp_path / "state"
    args = {"interface": "kubeon0", "kubelet_command": "true", "provider_id": "", "capacity": {}, "tunnel": False,
            "retry_seconds": 0.0, "redeem": redeem}
    assert main_join(config, state, **args) == 0  # type: ignore[arg-type]
    assert [r.ticket for r in redeemed] == ["the-ticket"]
    assert not config.exists()  # the ticket is nowhere on disk any more
    assert "the-ticket" not in "".join(p.read_text(errors="replace") for p in state.iterdir() if p.is_file())
    assert json.loads((state / "join-document.json").read_text())["nodeName"] == "burst-1"
    assert main_join(config, state, **args) == 0  # type: ignore[arg-type]  # the reboot: from the saved answer
    assert len(redeemed) == 1


def test_a_rerun_after_the_certificate_expired_renews_with_the_kubelet_key(tmp_path: Path) -> None:
    """A long reboot: the saved certificate expired and the ticket is gone; the rerun renews at the gateway with
    the kubelet key it joined with (no ticket), and a renewal for another key is never written."""
    from models.join import CertRenewalAnswer

    config = tmp_path / "join.json"
    user_data = render_user_data(gateway_url="https://gw.example:8443", ticket="the-ticket", node_name="burst-1",
                                 labels={}, taints=[])
    config.write_text(user_data.split("<<'KUBEON_JOIN'\n", 1)[1].split("\nKUBEON_JOIN", 1)[0])
    state = tmp_path / "state"
    key = kubelet_key(NodeFiles(state))
    renewals: list[CertRenewal] = []

    def renewer(request: CertRenewal) -> CertRenewalAnswer:
        renewals.append(request)
        return CertRenewalAnswer(certificate=_answer("burst-1", key=key).certificate)

    args = {"interface": "kubeon0", "kubelet_command": "true", "provider_id": "", "capacity": {}, "tunnel": False,
            "retry_seconds": 0.0}
    expired = _answer("burst-1", key=key, valid=-dt.timedelta(minutes=5))
    assert main_join(config, state, redeem=lambda _: expired, **args) == 0  # type: ignore[arg-type]
    files = NodeFiles(state)
    doc = json.loads(files.document.read_text())
    answer = join(doc, files, tunnel=False, renewer=renewer)
    assert len(renewals) == 1 and renewals[0].node_name == "burst-1"
    assert x509.load_pem_x509_certificate(answer.certificate.encode()).not_valid_after_utc > dt.datetime.now(dt.UTC)
    assert files.kubelet_cert.read_text() == answer.certificate

    def thief(request: CertRenewal) -> CertRenewalAnswer:  # a gateway answering with another key's certificate
        return CertRenewalAnswer(certificate=_answer("burst-1").certificate)

    with pytest.raises(JoinError, match="kept the current one"):
        renew(files, renewer=thief, force=True)
    assert files.kubelet_cert.read_text() == answer.certificate
