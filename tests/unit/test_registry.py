"""Registry: allowlisted names only, helpful errors, explicit plug-ins."""

import sys

import pytest

from llmrl import registry
from llmrl.registry import RegistryError


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_agents", dict(registry._agents))
    monkeypatch.setattr(registry, "_inference", dict(registry._inference))


def test_builtin_names_are_listed():
    assert {"arithmetic", "countdown", "math", "gsm8k", "code", "dataset", "remote"} <= set(
        registry.agent_names()
    )
    assert {"local", "openai"} <= set(registry.inference_names())


@pytest.mark.parametrize("name", ["nope", "os.system", "llmrl.envs.arithmetic:ArithmeticAgent", "", None])
def test_unknown_names_list_the_valid_ones(name):
    with pytest.raises(RegistryError) as info:
        registry.get_agent_class(name)
    message = str(info.value)
    assert "valid names: arithmetic, code, countdown" in message
    if name and "." in name:
        assert "Import paths are not accepted" in message


def test_import_paths_are_never_imported(monkeypatch, clean_registry):
    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    with pytest.raises(RegistryError):
        registry.get_inference_class("json.tool")
    assert "json.tool" not in sys.modules


def test_register_and_resolve(clean_registry):
    @registry.register_agent("my-env")
    class MyAgent:
        pass

    assert registry.get_agent_class("my-env") is MyAgent
    with pytest.raises(RegistryError, match="already registered"):
        registry.register_agent("my-env", type("Other", (), {}))
    replacement = registry.register_agent("my-env", type("Other", (), {}), replace=True)
    assert registry.get_agent_class("my-env") is replacement
    with pytest.raises(RegistryError, match="must be letters"):
        registry.register_inference("bad.name", MyAgent)


def test_plugins_register_themselves(tmp_path, monkeypatch, clean_registry):
    (tmp_path / "my_plugin.py").write_text(
        "from llmrl.registry import register_agent\n"
        "@register_agent('plugin-env')\n"
        "class PluginAgent:\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.import_plugins(["my_plugin"])
    assert registry.get_agent_class("plugin-env").__name__ == "PluginAgent"
    with pytest.raises(RegistryError, match="plugins: cannot import 'no_such_plugin_module'"):
        registry.import_plugins(["no_such_plugin_module"])


def test_registered_but_missing_module_is_a_clear_error(clean_registry, monkeypatch):
    monkeypatch.setitem(registry._agents, "ghost", "llmrl.envs.no_such_module:Ghost")
    with pytest.raises(RegistryError, match="'ghost' is registered but not available"):
        registry.get_agent_class("ghost")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("x = 1\n\nfoo()\n", "plugins: my_rewards.py:3: NameError: name 'foo' is not defined"),
        (  # the plug-in's own line, not the library's that raised
            "import json\n\ndef parse():\n    return json.loads('{')\n\nparse()\n",
            "plugins: my_rewards.py:4: JSONDecodeError: Expecting property name",
        ),
        ("def broken(:\n    pass\n", "plugins: my_rewards.py:1: SyntaxError: invalid syntax"),
    ],
)
def test_a_plugin_that_raises_on_import_is_one_line_naming_its_file_and_line(
    tmp_path, monkeypatch, clean_registry, source, message
):
    (tmp_path / "my_rewards.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    for entry in ("my_rewards.py", "my_rewards"):  # a file path or a module name
        with pytest.raises(RegistryError) as info:
            registry.import_plugins([entry])
        assert str(info.value).startswith(message) and "\n" not in str(info.value)
        assert "my_rewards" not in sys.modules
