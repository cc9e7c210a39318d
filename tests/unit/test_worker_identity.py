"""Worker ids: one per running agent, the same after a restart, new in a copied folder."""

from __future__ import annotations

import json
import shutil

from gpumesh.worker import identity


def test_an_agent_gets_its_id_back_after_a_restart_and_two_agents_get_two(tmp_path):
    first = identity.claim(tmp_path)
    second = identity.claim(tmp_path)  # a second agent of this folder, running beside it
    assert first.worker_id != second.worker_id
    assert not first.copied and not second.copied
    first_id = first.worker_id
    first.release()
    again = identity.claim(tmp_path)
    assert again.worker_id == first_id  # the restarted agent is the same worker
    again.release()
    second.release()
    assert oct((tmp_path / "workers" / "0.json").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "workers").stat().st_mode & 0o777) == "0o700"


def test_a_copied_folder_makes_a_new_id_and_the_original_keeps_its_own(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    original = identity.claim(home)
    original.release()
    copy = tmp_path / "copy"
    shutil.copytree(home, copy)  # a home folder copied to another machine (or place)
    copied = identity.claim(copy)
    assert copied.copied and copied.worker_id != original.worker_id
    kept = identity.claim(home)
    assert kept.worker_id == original.worker_id and not kept.copied
    copied.release()
    kept.release()
    later = identity.claim(copy)
    assert later.worker_id == copied.worker_id and not later.copied  # stable there from now on
    later.release()


def test_a_damaged_id_file_is_replaced(tmp_path):
    made = identity.claim(tmp_path)
    made.release()
    for damage in (b"{not json", json.dumps({"id": "../../etc", "machine": "x"}).encode(),
                   json.dumps(["a list"]).encode()):
        (tmp_path / "workers" / "0.json").write_bytes(damage)
        fresh = identity.claim(tmp_path)
        assert len(fresh.worker_id) == 12 and fresh.worker_id != "../../etc"
        fresh.release()
