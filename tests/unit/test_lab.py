"""``llmlab lab``'s Jupyter settings, read the way Jupyter reads them (the server itself: tests/engine/test_cli.py)."""

from __future__ import annotations


def test_the_lab_turns_off_setting_a_password_with_the_token(tmp_path, monkeypatch):
    """Finding 8 of security-review-2: with jupyter_server's default, a POST of ``password=<token>&new_password=X``
    to /login writes a lasting hashed password into ~/.jupyter.  The config ``llmlab lab`` puts first on
    JUPYTER_CONFIG_PATH turns that off, and it wins over the user's own ~/.jupyter; loaded as the server loads its
    config, the identity provider must say so (a misspelt trait would be ignored with a mere warning)."""
    from jupyter_server.auth.identity import PasswordIdentityProvider
    from jupyter_server.serverapp import ServerApp

    from llmlab.ops.cli import lab_environment

    user = tmp_path / "jupyter"
    user.mkdir()
    (user / "jupyter_server_config.json").write_text('{"PasswordIdentityProvider": {"allow_password_change": true}}')
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(user))
    monkeypatch.setenv("JUPYTER_CONFIG_PATH", lab_environment()["JUPYTER_CONFIG_PATH"])
    app = ServerApp()
    app.load_config_file()
    assert PasswordIdentityProvider(config=app.config).allow_password_change is False
    monkeypatch.delenv("JUPYTER_CONFIG_PATH")  # without the course's settings: the default, why the file exists
    plain = ServerApp()
    plain.load_config_file()
    assert PasswordIdentityProvider(config=plain.config).allow_password_change is True
