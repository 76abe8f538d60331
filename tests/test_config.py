"""torchmem.Config: defaults, parsing, errors naming the key, TORCHMEM_CONF, the generated docs."""

import os

import pytest

from torchmem.runtime import config
from support import REPO


def test_defaults_and_core_dict(monkeypatch):
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    cfg = config.Config()
    assert cfg.as_dict() == {option.name: option.default for option in config.OPTIONS}
    core = cfg.core_dict(80 << 30)
    assert core["limit_bytes"] == 0 and core["small_page_bytes"] == 2 << 20 and core["trace_capacity"] == 0


@pytest.mark.parametrize("value, expected", [
    ("512MiB", 512 << 20), ("8 GB", 8 << 30), ("1.5g", 3 << 29), (4096, 4096), (2.0 * (1 << 30), 2 << 30),
])
def test_sizes(value, expected):
    assert config.Config(reserve=value, limit="64GiB").reserve == expected


@pytest.mark.parametrize("value, expected_bytes", [("80%", int(0.8 * (10 << 30))), (0.5, 5 << 30), ("0.25", int(0.25 * (10 << 30))), ("2GiB", 2 << 30), (None, 0)])
def test_limit_forms(value, expected_bytes):
    assert config.Config(limit=value).limit_bytes(10 << 30) == expected_bytes


@pytest.mark.parametrize("options, words", [
    ({"colour": 1}, ["'colour'", "allowed", "limit"]),
    ({"backend": "cuda"}, ["'backend'", "vmm", "cuda_malloc"]),
    ({"limit": 1.5}, ["'limit'", "(0, 1]"]),
    ({"limit": "1MiB"}, ["'limit'", "granule"]),
    ({"limit": 0}, ["'limit'", "None"]),
    ({"reserve": "lots"}, ["'reserve'", "512MiB"]),
    ({"reserve": -1}, ["'reserve'", ">= 0"]),
    ({"small_page": 3 << 20}, ["'small_page'", "multiple of 2 MiB"]),
    ({"small_threshold": 4 << 20}, ["'small_threshold'"]),
    ({"debug_checks": "maybe"}, ["'debug_checks'", "true or false"]),
    ({"oom_hook_retries": 1000}, ["'oom_hook_retries'", "[0, 100]"]),
    ({"reserve": "4GiB", "limit": "2GiB"}, ["'reserve'", "exceeds"]),
])
def test_bad_values_name_the_key(options, words):
    with pytest.raises(ValueError) as info:
        config.Config(**options)
    for word in words:
        assert word in str(info.value)


def test_conf_string_and_precedence(monkeypatch):
    assert config.parse_conf_string("limit=80%, backend=vmm,") == {"limit": "80%", "backend": "vmm"}
    monkeypatch.setenv(config.ENV_VAR, "limit=50%,debug_checks=1,reclaim_slack=0.01")
    cfg = config.from_env_and_kwargs(debug_checks=False)
    assert cfg.limit == 0.5 and cfg.debug_checks is False and cfg.reclaim_slack == 0.01
    for bad, word in (("limit", "key=value"), ("nope=1", "'nope'"), ("limit=1g,limit=2g", "twice")):
        with pytest.raises(ValueError, match=word):
            config.parse_conf_string(bad)


def test_config_is_immutable_and_replace_validates():
    cfg = config.Config(limit="4GiB")
    with pytest.raises(AttributeError):
        cfg.limit = 1
    assert cfg.replace(reserve="1GiB").reserve == 1 << 30 and cfg.reserve == 0
    with pytest.raises(ValueError, match="'reserve'"):
        cfg.replace(reserve="8GiB")
    assert "limit=4294967296" in repr(cfg)


def test_docs_table_is_generated_from_options():
    with open(os.path.join(REPO, "docs", "config.md")) as f:
        assert f.read() == config.options_markdown(), (
            "docs/config.md is stale: run `python -m torchmem.runtime.config --markdown > docs/config.md`"
        )
    for option in config.OPTIONS:
        assert f"| `{option.name}` |" in config.options_markdown()


def test_core_dict_covers_every_pool_config_field():
    # PoolConfig's fields are declared once in C++ (TORCHMEM_POOL_CONFIG); the
    # Python options must feed every one of them, with the same defaults.
    from torchmem import _C

    fields = {name: default for name, _kind, default, _doc in _C.pool_config_fields()}
    core = config.Config().core_dict(80 << 30)
    assert set(core) == set(fields)
    for name, default in fields.items():
        if name != "limit_bytes":
            assert core[name] == default, name


def test_every_config_applies_torchmem_conf_and_explicit_arguments_win(monkeypatch):
    from torchmem.analysis import replay

    monkeypatch.setenv(config.ENV_VAR, "limit=4GiB,reclaim_slack=0.5")
    cfg = config.Config(reclaim_slack=0.25)
    assert cfg.limit == 4 << 30 and cfg.reclaim_slack == 0.25
    assert config.Config() == config.from_env_and_kwargs()
    assert replay.pool_config()["limit_bytes"] == 4 << 30
    assert replay.pool_config({"limit": "8GiB"})["limit_bytes"] == 8 << 30
    assert config.Config.defaults().limit is None
    monkeypatch.setenv(config.ENV_VAR, "limit=1GiB")
    assert cfg.replace(debug_checks=True).limit == 4 << 30  # replace() keeps the Config's own values
    monkeypatch.setenv(config.ENV_VAR, "limit=lots")
    with pytest.raises(ValueError, match="TORCHMEM_CONF='limit=lots'.*'limit'"):
        config.Config()


def test_run_below_limit_is_auto_by_default_and_follows_share(monkeypatch):
    # None = auto: runs under the limit only in a sharing group, whose limit keeps moving
    monkeypatch.delenv(config.ENV_VAR, raising=False)
    assert config.Config().run_below_limit is None
    assert config.Config().core_dict(80 << 30)["run_below_limit"] == 0.0
    shared = config.Config(share="team", guarantee="30GiB")
    assert shared.core_dict(80 << 30)["run_below_limit"] == config.SHARE_RUN_BELOW_LIMIT == 0.5
    assert config.Config(share="team", guarantee="30GiB", run_below_limit=0).core_dict(1 << 30)["run_below_limit"] == 0
    assert config.Config(run_below_limit="auto").run_below_limit is None
    assert config.Config(run_below_limit="0.8").core_dict(1 << 30)["run_below_limit"] == 0.8
    with pytest.raises(ValueError, match="'run_below_limit': must be in"):
        config.Config(run_below_limit=2)


def test_install_hands_the_resolved_run_below_limit_to_the_runtime(monkeypatch):
    # torchmem.install() builds the runtime's options from pool_options: the shim never sees None
    import importlib

    install = importlib.import_module("torchmem.installer")  # the module; torchmem.install is the function

    monkeypatch.delenv(config.ENV_VAR, raising=False)
    shared = install._runtime_options(config.Config(share="team", guarantee="30GiB"))
    assert shared["run_below_limit"] == 0.5 and shared["limit"] == 30 << 30
    assert install._runtime_options(config.Config(limit="20GiB"))["run_below_limit"] == 0.0


def test_the_limit_reaches_the_runtime_once_as_given():
    # The limit goes config -> runtime -> each device's Budget, which resolves it (csrc/shim/budget.h):
    # no resolved limit_bytes travels beside it, and a fraction stays a fraction.
    import importlib

    install = importlib.import_module("torchmem.installer")
    for limit, given in (("20GiB", 20 << 30), (0.25, 0.25), (None, None)):
        options = install._runtime_options(config.Config(limit=limit))
        assert "limit_bytes" not in options and options["limit"] == given
    cfg = config.Config(limit=0.5)
    assert cfg.core_dict(80 << 30) == {"limit_bytes": 40 << 30, **cfg.pool_options()}
