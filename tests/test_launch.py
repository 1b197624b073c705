"""The console script's OpenBLAS preload: when it re-executes, and with what."""

from daemon.launch import OPENBLAS, preload_environment


def test_preloads_on_linux_x86_when_installed_and_absent():
    env = preload_environment({"PATH": "/bin"}, "Linux", "x86_64", installed=True)
    assert env == {"PATH": "/bin", "LD_PRELOAD": OPENBLAS}
    # Other preloads are kept, after ours.
    env = preload_environment({"LD_PRELOAD": "/lib/libother.so"}, "Linux", "x86_64", installed=True)
    assert env["LD_PRELOAD"] == f"{OPENBLAS}:/lib/libother.so"


def test_goes_on_as_is_otherwise():
    for preloaded in (OPENBLAS, f"/lib/a.so:{OPENBLAS}", f"/lib/a.so {OPENBLAS}"):  # already there: no loop
        assert preload_environment({"LD_PRELOAD": preloaded}, "Linux", "x86_64", installed=True) is None
    assert preload_environment({}, "Linux", "x86_64", installed=False) is None
    assert preload_environment({}, "Darwin", "arm64", installed=True) is None
    assert preload_environment({}, "Linux", "aarch64", installed=True) is None
    assert preload_environment({"LANESERVE_NO_PRELOAD": "1"}, "Linux", "x86_64", installed=True) is None
