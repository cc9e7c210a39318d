"""Which coordinator ``gpumesh join`` dials, from what is saved and what is given."""

from __future__ import annotations


def test_join_with_another_meshs_token_does_not_dial_the_saved_address(tmp_path):
    # README: the token decides which coordinator join picks. The saved URL (this machine's
    # own coordinator) was dialled with a friend's token, and join exited on the handshake.
    from gpumesh.cli.join import with_saved
    from gpumesh.config import Settings, save_connection

    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path)})
    mine, friends = "m" * 43, "f" * 43
    save_connection(settings.config_path, "tcp://127.0.0.1:8000", mine, slots=3)
    assert with_saved(settings, None, mine, None)[0] == "tcp://127.0.0.1:8000"
    url, token, slots, saved = with_saved(settings, None, friends, None)
    assert (url, token, slots, saved) == (None, friends, None, None)  # found on the LAN
