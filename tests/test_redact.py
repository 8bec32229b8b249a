"""Redaction: home folders, hostnames, user names and secret-looking variables never reach what is pasted
(`report --format issue|markdown`), and `--no-redact` keeps them; the fingerprint records who and where
without showing it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from attn_doctor.machine.fingerprint import (
    EnvReport,
    collect_env,
    collect_env_vars,
    looks_secret,
)
from attn_doctor.machine.env_rows import env_rows
from attn_doctor.render.env_view import env_markdown
from attn_doctor.render.redact import Identity, identity_from, identity_of, redact

DATA = Path(__file__).resolve().parent / "data" / "results-fixed.json"

HOST, SHORT_HOST, USER, HOME = "gpu-node-7.example.org", "gpu-node-7", "alice", "/home/alice"
TOKEN, API_KEY = "hf_SeCrEt0123456789", "sk-live-abcdef123456"
IDENTIFYING = (HOST, SHORT_HOST, USER, HOME, TOKEN, API_KEY)


@pytest.fixture
def planted(tmp_path) -> Path:
    """The fixed document made on alice's machine: its fingerprint names her host, user and home and holds two
    secret-looking variables; her paths, host and token are in its command, a reason and a crash's detail."""
    document = json.loads(DATA.read_text())
    env = document["env"]
    env["identity"] = {"hostname": HOST, "user": USER, "home": HOME}
    env["env_vars"].update({"HF_TOKEN": TOKEN, "NVTE_TEST_API_KEY": API_KEY})
    document["command"] = f"attn-doctor run --json {HOME}/runs/{SHORT_HOST}/results.json"
    for row in document["results"]:
        if row["verdict"] == "ERROR":
            row["detail"] += (f'\n  File "{HOME}/.venv/lib/python3.12/site-packages/x.py", line 3\n'
                              f"RuntimeError: NCCL on {SHORT_HOST} failed for user {USER} with HF_TOKEN={TOKEN}")
        if row["backend"] == "nan_one_head_dk":
            row["reason"] += f" (on {HOST.upper()})"
    path = tmp_path / "results.json"
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize("fmt", ["issue", "markdown"])
def test_pasted_formats_show_no_identity(fmt, planted, run_cli):
    result = run_cli(["report", planted, "--format", fmt])
    assert result.exit_code == 0, result.output
    text = result.stdout.lower()
    for secret in IDENTIFYING:
        assert secret.lower() not in text, secret
    assert "/home/" not in text
    if fmt == "markdown":  # the crash's detail and the full environment are in it, redacted
        assert "failed for user [user] with hf_token=[redacted]" in text
        assert "nvte_test_api_key=[redacted]" in text and "~/.venv/lib/python3.12" in text
    assert "~/runs/[hostname]/results.json" in text  # the command, in the footer and its repro's header


@pytest.mark.parametrize("fmt", ["issue", "markdown"])
def test_no_redact_keeps_them(fmt, planted, run_cli):
    result = run_cli(["report", planted, "--format", fmt, "--no-redact"])
    assert result.exit_code == 0, result.output
    assert f"{HOME}/runs/{SHORT_HOST}/results.json" in result.stdout
    assert API_KEY in result.stdout  # an NVTE_ variable: in the environment table of both
    if fmt == "markdown":
        assert TOKEN in result.stdout and f"user {USER}" in result.stdout


def test_other_formats_are_not_redacted(planted, run_cli):
    """json and csv are data, not for pasting: the document read back whole."""
    result = run_cli(["report", planted, "--format", "json"])
    assert json.loads(result.stdout)["env"]["identity"]["hostname"] == HOST


def test_redact_names_homes_hosts_users_and_secrets():
    identity = identity_from({"hostname": HOST, "user": USER, "home": HOME}, {"HF_TOKEN": TOKEN, "NVTE_X": "1"})
    text = (f"--json {HOME}/r.json on {HOST} and {SHORT_HOST.upper()}: {USER}@{SHORT_HOST} pytest-of-{USER} "
            f"/home/bob/x /Users/carol/y /root/.cache /rooted token {TOKEN} aliceX NVTE_X=1 HF_TOKEN={TOKEN}<br>")
    assert redact(text, identity) == (
        "--json ~/r.json on [hostname] and [hostname]: [user]@[hostname] pytest-of-[user] ~/x ~/y ~/.cache /rooted "
        "token [redacted] aliceX NVTE_X=1 HF_TOKEN=[redacted]<br>")
    assert "bob" not in redact("/home/bob/a and bob's run", Identity())  # any home folder names its user


def test_redact_catches_secret_assignments_it_was_not_told_of():
    text = "WANDB_API_KEY=abc\\|def | AWS_SECRET_ACCESS_KEY='x' DB_PASSWORD=hunter2 NVTE_DEBUG=1 key=lambda x: x"
    assert redact(text, Identity()) == (
        "WANDB_API_KEY=[redacted] | AWS_SECRET_ACCESS_KEY='x' DB_PASSWORD=[redacted] NVTE_DEBUG=1 key=lambda x: x")


def test_redact_leaves_short_and_generic_names_alone():
    """A hostname like "vm" or an account like "root" or "runner" would hit ordinary words."""
    identity = identity_from({"hostname": "vm", "user": "runner", "home": "/home/runner"}, {"GH_TOKEN": "1"})
    text = "the vm runner sets GH_TOKEN to 1 in /home/runner/work"
    assert redact(text, identity) == "the vm runner sets GH_TOKEN to 1 in ~/work"


def test_fingerprint_records_who_and_where_but_never_shows_it(monkeypatch):
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    monkeypatch.setenv("NVTE_SOME_AUTH_TOKEN", "secret-value-123")
    monkeypatch.setenv("CUDA_CREDENTIAL_FILE", "/x")
    env = collect_env(read_te=False)
    assert set(env.identity) == {"hostname", "user", "home"}
    assert EnvReport.from_dict(json.loads(json.dumps(env.to_dict()))) == env
    assert "NVTE_FUSED_ATTN" in env.env_vars
    assert not [name for name in env.env_vars if looks_secret(name)]  # never collected
    anonymous = dataclasses.replace(env, identity={})
    assert env_rows(env) == env_rows(anonymous) and env_markdown(env) == env_markdown(anonymous)  # shows nothing of it
    assert identity_of(env).hostnames >= {env.identity["hostname"]}


def test_older_documents_have_no_identity():
    document = json.loads(DATA.read_text())
    env = EnvReport.from_dict(document["env"])
    assert env.identity == {} and "identity" not in env.to_dict()
    assert identity_of(env) == Identity() and identity_of(None) == Identity()


@pytest.mark.parametrize("name, secret", [("HF_TOKEN", True), ("WANDB_API_KEY", True), ("NVTE_FLASH_ATTN", False),
                                          ("AWS_SECRET_ACCESS_KEY", True), ("GOOGLE_CREDENTIALS", True),
                                          ("NCCL_IB_AUTH", True), ("CUDA_VISIBLE_DEVICES", False)])
def test_looks_secret(name, secret):
    assert looks_secret(name) is secret
    assert (name in collect_env_vars({name: "v"})) is (not secret and name.startswith(("NVTE_", "CUDA_", "NCCL_")))
