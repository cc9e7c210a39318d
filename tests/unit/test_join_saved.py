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


def test_joining_another_mesh_keeps_this_machines_own_coordinator_saved(tmp_path):
    # Replaced by the friend's connection, the next plain `gpumesh serve` found no token of
    # its own, made a new one, and this machine's workers were locked out.
    from gpumesh.cli.join import keeps_own_coordinator
    from gpumesh.config import Settings, save_connection

    settings = Settings.from_env({"GPUMESH_HOME": str(tmp_path)})
    mine, friends = "m" * 43, "f" * 43
    save_connection(settings.config_path, "tcp://127.0.0.1:8000", mine,
                    served=("127.0.0.1", 8000))
    assert keeps_own_coordinator(settings, friends)
    assert not keeps_own_coordinator(settings, mine)
    save_connection(settings.config_path, "tcp://127.0.0.1:8000", mine)  # a worker's, not served
    assert not keeps_own_coordinator(settings, friends)
    # No connection saved, but the token file of a coordinator that ran here: kept too.
    settings.config_path.unlink()
    (tmp_path / "token").write_text(mine + "\n")
    assert keeps_own_coordinator(settings, friends)
    assert not keeps_own_coordinator(settings, mine)
