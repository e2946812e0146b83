"""The one exception tree: every class declares a sane HTTP status and exit code, servers answer with
it in the envelope, the CLIs with one line; the Hub boundary maps every huggingface_hub error."""

from __future__ import annotations

import inspect

import pytest

from larql_edge import errors as E
from larql_edge.tools.slicer import hub as H


def test_every_error_declares_a_status_kind_and_exit_code():
    classes = E.all_errors()
    assert len(classes) >= 30
    for cls in classes:
        assert 400 <= cls.status <= 599, cls
        assert cls.exit_code != 0 and cls.kind, cls
    # every error defined in the module is part of the tree (no second root)
    defined = [c for _, c in inspect.getmembers(E, inspect.isclass) if issubclass(c, BaseException) and c.__module__ == E.__name__]
    assert set(defined) == set(classes)
    # the caller's mistakes are 4xx, ours and dependencies' 5xx
    assert E.WireError.status == E.ProtocolError.status == 400
    assert E.VindexError.status == 503 and E.TransportError.status == 502 and E.TimedOut.status == 504


def test_no_other_exception_class_in_the_package_outside_the_tree():
    """Ad-hoc exception classes are the mess this tree replaced: the only others are private control flow."""
    import importlib
    import pkgutil

    import larql_edge

    strays = []
    for m in pkgutil.walk_packages(larql_edge.__path__, "larql_edge."):
        if m.name.endswith("_mlx") or ".testing." in m.name:
            continue
        mod = importlib.import_module(m.name)
        for name, cls in inspect.getmembers(mod, inspect.isclass):
            if (cls.__module__ == mod.__name__ and issubclass(cls, BaseException) and not issubclass(cls, E.LarqlError)
                    and not name.startswith("_")):  # private: control flow inside one module
                strays.append(f"{m.name}.{name}")
    # Control flow between the router's modules; never raised to a caller.
    assert sorted(strays) == ["larql_edge.roles.router.upstream.MemberFailed", "larql_edge.roles.router.upstream.MemberSlow",
                              "larql_edge.roles.router.walk.Passthrough"]


def test_envelope_uses_the_declared_status():
    from larql_edge.service._envelope import response_for

    for cls, arg in ((E.BadRequest, "x"), (E.Conflict, "x"), (E.ServiceUnavailable, "x"), (E.HubGated, "x")):
        r = response_for(cls(arg), None)
        assert r.status == cls.status and b'"error":"x"' in r.body
    r = response_for(E.TooManyRequests("busy", retry_after=2.2), None)
    assert r.status == 429 and r.headers["Retry-After"] == "3"
    r = response_for(RuntimeError("secret details"), None)
    assert r.status == 500 and b"secret" not in r.body


def test_cli_boundary_is_one_line_with_the_exit_code(capsys):
    import argparse

    from larql_edge.console import run_command

    def boom(exc):
        return argparse.Namespace(command="x", func=lambda a: (_ for _ in ()).throw(exc))

    assert run_command("larql-test", boom(E.SliceError("bad slice"))) == 1
    assert capsys.readouterr().err == "larql-test x: error: bad slice\n"
    assert run_command("larql-test", boom(PermissionError(13, "Permission denied", "/ro/out"))) == 1
    assert capsys.readouterr().err == "larql-test x: error: Permission denied: /ro/out\n"
    assert run_command("larql-test", boom(KeyboardInterrupt())) == 130


# -- the Hub boundary -------------------------------------------------------------------------------


def test_every_huggingface_hub_error_class_is_mapped():
    """Fails when a huggingface_hub release adds an error class nobody has decided about."""
    from huggingface_hub import errors as hf

    classes = {n for n, c in inspect.getmembers(hf, inspect.isclass)
               if issubclass(c, BaseException) and c.__module__.startswith("huggingface_hub")}
    assert classes - set(H.FOREIGN) == set(), "map these in larql_edge/tools/slicer/hub.py FOREIGN"
    assert set(H.FOREIGN) - classes == set(), "these are no longer in huggingface_hub.errors"


def _http_error(cls_name: str, status: int):
    import httpx
    from huggingface_hub import errors as hf

    req = httpx.Request("GET", "http://hub.test/api/datasets/o/n")
    resp = httpx.Response(status, request=req)
    return getattr(hf, cls_name)("message from the Hub", response=resp)


@pytest.mark.parametrize("cls_name,status,want", [
    ("GatedRepoError", 403, E.HubGated),  # a RepositoryNotFoundError subclass: must not read as missing
    ("RepositoryNotFoundError", 404, E.HubNotFound),
    ("RevisionNotFoundError", 404, E.HubRevisionNotFound),
    ("RemoteEntryNotFoundError", 404, E.HubNotFound),
    ("EgressLimitError", 402, E.HubForbidden),  # huggingface_hub 2.5: the download allowance is used up
    ("HfHubHTTPError", 401, E.HubUnauthorized),
    ("HfHubHTTPError", 403, E.HubForbidden),
    ("HfHubHTTPError", 404, E.HubNotFound),
    ("HfHubHTTPError", 429, E.HubRateLimited),
    ("HfHubHTTPError", 500, E.HubUnavailable),
    ("HfHubHTTPError", 503, E.HubUnavailable),
])
def test_http_errors_map_to_the_right_class(cls_name, status, want):
    got = H.translate(_http_error(cls_name, status), "pull o/n")
    assert type(got) is want, (got, want)
    assert got.message.startswith("pull o/n: ")


def test_non_http_foreign_errors():
    from huggingface_hub import errors as hf

    assert type(H.translate(hf.OfflineModeIsEnabled("x"), "w")) is E.HubUnavailable
    assert type(H.translate(hf.HFValidationError("bad id"), "w")) is E.HubInvalid
    assert type(H.translate(ConnectionError("reset"), "w")) is E.HubUnavailable
    assert type(H.translate(ValueError("Invalid path"), "w")) is E.HubInvalid
    with pytest.raises(KeyError):  # a bug of ours is not translated into a Hub error
        H.translate(KeyError("x"), "w")


@pytest.mark.parametrize("status,code,want,words", [
    (403, "GatedRepo", E.HubGated, "gated"),
    (404, "RevisionNotFound", E.HubRevisionNotFound, "revision not found"),
    (404, "RepoNotFound", E.HubNotFound, "not found"),
    (401, None, E.HubUnauthorized, "not authorized"),
    (403, None, E.HubForbidden, "forbidden"),
    # huggingface_hub retries these with backoff for ~24 s before it raises: the slow tier.
    pytest.param(429, None, E.HubRateLimited, "rate limited", marks=pytest.mark.slow),
    pytest.param(502, None, E.HubUnavailable, "retry later", marks=pytest.mark.slow),
])
def test_the_unmodified_client_against_a_failing_hub(hub, tmp_path, status, code, want, words):
    """The real huggingface_hub client, a real Hub-protocol server answering the failure."""
    from larql_edge.tools.slicer.pull import pull

    hub.create_repo("test-user/m")
    hub.respond_with("GET", r"/api/datasets/test-user/m", status, error_code=code)
    with pytest.raises(want, match=words):
        pull("test-user/m", output=tmp_path / "o", endpoint=hub.url, token=hub.token, log=lambda m: None, hints=False)
    assert not (tmp_path / "o").exists()
