"""The admin credential stays secret: tritonserver gets it on its argv only (r24.10 takes
it nowhere else), every command line or log excerpt shown goes through ``flags.redact`` /
``flags.redact_text``, and tritonserver's environment (which every stub inherits) never holds
it. The live checks, against real servers, are in tests/live/test_security.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tritonlocal import LauncherError, ServerOptions, TritonServer, flags, runtime

SECRET = "0123456789abcdef" * 2  # a made-up credential (assembled: no secret-looking literal)
TOKEN = (flags.ADMIN_HEADER, SECRET)


def test_redact_hides_the_value_of_every_restriction_flag_and_keeps_the_rest():
    command = ["tritonserver", *flags.container_flags(TOKEN, "/models"), "--log-verbose=1"]
    shown = flags.redact(command)
    assert SECRET not in " ".join(shown)
    assert len(shown) == len(command)
    changed = [(a, b) for a, b in zip(command, shown) if a != b]
    apis = ",".join(flags.RESTRICTED_APIS)
    assert [b for _, b in changed] == [
        f"--http-restricted-api={apis}:{flags.ADMIN_HEADER}={flags.REDACTED}",
        f"--grpc-restricted-protocol={apis}:{flags.ADMIN_HEADER}={flags.REDACTED}"]


def test_redact_hides_an_admin_header_given_in_any_form_getopt_takes():
    apis = ",".join(flags.RESTRICTED_APIS)
    command = ["--http-restricted-api", f"{apis}:key={SECRET}",   # value as the next argument
               f"--grpc-restricted={apis}:key={SECRET}",          # an abbreviation getopt_long takes
               "--http-restricted-api=garbled" + SECRET,          # not a rule: all of it hidden
               "--http-port=8000", "--model-repository=/m"]
    shown = flags.redact(command)
    assert SECRET not in " ".join(shown)
    assert shown == ["--http-restricted-api", f"{apis}:key={flags.REDACTED}",
                     f"--grpc-restricted={apis}:key={flags.REDACTED}",
                     f"--http-restricted-api={flags.REDACTED}", "--http-port=8000",
                     "--model-repository=/m"]


def test_redact_text_hides_rules_in_text_and_the_values_it_is_given():
    line = f"E1126 error parsing --http-restricted-api=model-repository:{TOKEN[0]}={SECRET}: bad"
    assert flags.redact_text(line) == (f"E1126 error parsing --http-restricted-api="
                                       f"model-repository:{TOKEN[0]}={flags.REDACTED}: bad")
    assert flags.redact_text(f"header value {SECRET}!", SECRET, "") == \
        f"header value {flags.REDACTED}!"
    assert flags.redact_text("nothing to hide", SECRET) == "nothing to hide"


def test_the_redact_command_mode_prints_the_command_without_the_value(capsys, monkeypatch):
    import io
    import sys

    command = ["tritonserver", *flags.container_flags(TOKEN, "/m"), "--a b"]
    stdin = io.TextIOWrapper(io.BytesIO(b"".join(a.encode() + b"\0" for a in command)))
    monkeypatch.setattr(sys, "stdin", stdin)
    assert flags.main(["--redact-command"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out
    assert out == " ".join(flags.redact(command)) + "\n"


def test_the_servers_environment_never_holds_a_header(monkeypatch):
    """Every python-backend stub inherits tritonserver's environment: any model's code would read
    the admin credential there."""
    for name in flags.SECRET_VARIABLES:
        monkeypatch.setenv(name, f"{flags.ADMIN_HEADER}={SECRET}")
    install = runtime.find_installation()
    env = runtime.server_environment(install, "/opt/venv/bin/python")
    assert not set(flags.SECRET_VARIABLES) & set(env)
    assert SECRET not in "".join(env.values())


def test_server_options_do_not_show_the_admin_header():
    options = ServerOptions(Path("/m"), admin_header=("triton-admin-key", SECRET))
    assert SECRET not in repr(options) and SECRET not in str(options)


@pytest.mark.parametrize("admin", [None, ("triton-admin-key", SECRET)])
def test_the_log_tail_quoted_in_errors_is_redacted(tmp_path, admin):
    server = TritonServer(ServerOptions(tmp_path, admin_header=admin))
    if admin is None:
        server.credential = TOKEN
    server.log_file = tmp_path / "tritonserver.log"
    server.log_file.write_text(f"# tritonserver --http-restricted-api=x:y={SECRET}\n"
                               f"a line quoting {SECRET} alone\n")
    tail = server.log_tail()
    assert SECRET not in tail
    assert tail.count(flags.REDACTED) == 2


def test_the_credential_file_is_private_and_never_replaces_a_file_of_the_users(tmp_path):
    server = TritonServer(ServerOptions(tmp_path))
    mine = tmp_path / "notes.txt"
    mine.write_text("the user's own notes\n")
    with pytest.raises(LauncherError, match="not overwritten"):
        server._write_credential(mine)
    assert mine.read_text() == "the user's own notes\n" and server.credential_file is None
    stale = tmp_path / "admin.header"
    stale.write_text(f"{flags.ADMIN_HEADER}: {'0' * 64}\n")  # a killed launcher's
    stale.chmod(0o644)
    server._write_credential(stale)
    assert stale.stat().st_mode & 0o777 == 0o600
    assert flags.read_credential(stale) == server.credential != (flags.ADMIN_HEADER, "0" * 64)
    assert stale.read_text() == flags.header_line(server.credential) + "\n"


def test_benchmark_reports_print_perf_analyzers_headers_redacted():
    from bench.perf import Run

    run = Run(["/x/perf_analyzer", "-m", "tagger", "-H", flags.header_line(TOKEN),
               "--shared-memory", "system"])
    assert SECRET not in run.command_line
    assert run.command_line == ("perf_analyzer -m tagger -H "
                                f"'{flags.ADMIN_HEADER}: {flags.REDACTED}' --shared-memory system")
