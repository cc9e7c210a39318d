"""The dashboard as a user sees it: headless Chromium against a live mesh (one for the module).

Workers appear in the picture and the list, with their GPUs' use (a worker reading a stand-in
``nvidia-smi``), traffic on the edges, paused and lost states; a running job's progress bar
moves, a failed task's error and remote traceback show (as text, never as markup), cancel and
drain work from the page. Screenshots are saved to GPUMESH_TEST_ARTIFACTS (default:
tests/artifacts/, git-ignored), each checked to be there. The slow test follows a 1,000-task
``.map`` on three workers as a new user would (``pytest -m slow``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import Mesh, require, wait_for
from dashboard_tasks import explode, pause

from gpumesh.dashboard import Dashboard, tls
from gpumesh.errors import ConnectionFailed

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TESTS = Path(__file__).resolve().parent.parent
FAKES = TESTS / "fakes"  # nvidia-smi: two boards, 37 % and 81 % busy, 6 and 20 of 24 GiB in use
GPU_NAME = "NVIDIA RTX 4090"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def artifacts() -> Path:
    chosen = os.environ.get("GPUMESH_TEST_ARTIFACTS")
    folder = Path(chosen) if chosen else TESTS / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def shot(page: Any, artifacts: Path, name: str, **options: Any) -> Path:
    """Save a screenshot as a test artifact and check it is there: a PNG, not empty. Written
    under a temporary name and moved into place, so a run beside this one (same checkout)
    never sees half a file."""
    path = artifacts / f"{name}.png"
    part = artifacts / f".{name}.{os.getpid()}.png"
    page.screenshot(path=str(part), **options)
    os.replace(part, path)
    data = path.read_bytes()
    assert len(data) > len(PNG) and data.startswith(PNG), f"{path} is not a saved screenshot"
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require("playwright")  # skips locally without it, fails under CI=true
    from playwright.sync_api import sync_playwright
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"chromium is missing at {CHROMIUM}: .ci/run installs it")
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    playwright = sync_playwright().start()
    try:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield launched
        finally:
            launched.close()
    finally:
        playwright.stop()


@pytest.fixture(scope="module")
def live(browser: Any,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mesh, Any, Dashboard]]:
    mesh = Mesh(tmp_path_factory.mktemp("mesh"))
    dashboard = context = None
    try:
        mesh.start_coordinator()
        mesh.add_worker(slots=2)
        mesh.add_worker(slots=2)
        client = mesh.client()
        mesh.wait_workers(2, client)
        dashboard = Dashboard(client, mesh.token, port=0, interval=0.5)
        dashboard.start()
        context = browser.new_context(viewport={"width": 1600, "height": 1100})
        page = context.new_page()
        missing: list[str] = []
        page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
        page.goto(dashboard.url)
        page.wait_for_selector("#conn.live")
        assert missing == []  # no favicon.ico 404 on load
        yield mesh, page, dashboard
    finally:
        if context is not None:
            context.close()
        if dashboard is not None:
            dashboard.close()
        mesh.close()


def fake_gpu_env(hostname: str) -> dict[str, str]:
    """A worker that reads two GPUs through the stand-in nvidia-smi and names them."""
    inventory = {"hostname": hostname, "gpus": [{"name": GPU_NAME, "vram": 24564 * 2**20}] * 2}
    return {"PATH": f"{FAKES}{os.pathsep}{os.environ.get('PATH', '')}",
            "GPUMESH_TEST_INVENTORY": json.dumps(inventory)}


@pytest.fixture(scope="module")
def gpu_worker(live: tuple[Mesh, Any, Dashboard]) -> Any:
    """A third worker, joined to the live mesh when a test first asks for it."""
    mesh, page, _ = live
    handle = mesh.add_worker(slots=1, env=fake_gpu_env("gpubox"))
    page.locator(f'#workers .worker[data-worker="{handle.worker_id}"]').wait_for()
    return handle


def test_the_workers_appear_with_their_load(live, artifacts):
    mesh, page, _ = live
    page.wait_for_selector("#conn.live")
    page.wait_for_function("document.querySelectorAll('#workers .worker').length === 2")
    assert page.locator("#mesh g.node").count() == 2
    page.wait_for_selector("#workers .worker .bar")  # the heartbeats' CPU/RAM figures
    assert "journal" in page.locator("#health").inner_text()
    # Two workers of one machine share its hostname: the short worker id tells them apart.
    names = page.locator("#workers .worker .name").all_inner_texts()
    assert len(set(names)) == 2 and all("(" in name for name in names)
    # At 1,600 px the cards use the width: the events sit beside the charts, not below them.
    charts = page.locator("#charts-card").bounding_box()
    events = page.locator("#events-card").bounding_box()
    assert charts and events and events["y"] == charts["y"] and events["x"] > 1100
    shot(page, artifacts, "dashboard-workers", full_page=True)


def test_a_workers_gpus_show_their_name_use_and_vram(live, gpu_worker, artifacts):
    mesh, page, _ = live
    card = page.locator(f'#workers .worker[data-worker="{gpu_worker.worker_id}"]')
    node = page.locator(f'#mesh g.node[data-worker="{gpu_worker.worker_id}"]')
    assert GPU_NAME in card.inner_text()
    assert GPU_NAME in (node.text_content() or "")

    def bar(label: str) -> Any:
        return card.locator(".bar").filter(has=page.locator(f'span:text-is("{label}")'))

    # The first sample comes with a heartbeat or two after the join.
    bar("GPU 1 VRAM").wait_for(timeout=15_000)
    figures = {label: (bar(label).locator(".muted").inner_text(),
                       bar(label).locator(".meter > div").get_attribute("style"))
               for label in ("GPU 0 util", "GPU 0 VRAM", "GPU 1 util", "GPU 1 VRAM")}
    assert figures == {
        "GPU 0 util": ("37 %", "width: 37%;"),
        "GPU 0 VRAM": ("6.0 GiB / 24 GiB", "width: 25%;"),
        "GPU 1 util": ("81 %", "width: 81%;"),
        "GPU 1 VRAM": ("20 GiB / 24 GiB", "width: 83%;"),
    }
    # Workers without a GPU show none: their cards have CPU and RAM bars only.
    others = page.locator("#workers .worker").filter(has_not_text=GPU_NAME)
    assert others.count() >= 1 and others.locator(".bar", has_text="GPU").count() == 0
    shot(page, artifacts, "dashboard-gpus", full_page=True)


def test_a_running_jobs_progress_advances(live, artifacts, tmp_path):
    mesh, page, _ = live
    client = mesh.clients[0]
    # Half the tasks run until the test opens the gate: a loaded machine cannot finish the job
    # before the page has shown it part-way, with work moving on the edges.
    gate = str(tmp_path / "gate")
    calls = [((0.25,), {}) for _ in range(8)] + [((60,), {"gate": gate}) for _ in range(8)]
    futures = client.submit_calls(pause, calls, job="progressjob", name="progress")
    row = page.locator('#jobs tr[data-job="progressjob"]')
    row.wait_for()
    bar = row.locator(".progress")
    wait_for(lambda: 0 < int(bar.get_attribute("data-finished") or 0) < 16, 20,
             "the job part-way through")
    part = int(bar.get_attribute("data-finished") or 0)
    # Work moving on an edge: its rate is written on it (idle edges carry no label).
    labels = page.locator("#mesh text.edge-label")
    rate = re.compile(r"\d+(\.\d)? (B|KiB|MiB|GiB)/s")
    wait_for(lambda: any(rate.fullmatch(t) for t in labels.all_text_contents()), 10,
             "a traffic label on an edge")
    assert page.locator("#mesh line").count() == page.locator("#mesh g.node").count()
    # Every node's labels stay inside the picture, the far left and right ones included.
    outside = page.evaluate("""() => [...document.querySelectorAll('#mesh g.node text')]
        .map((t) => t.getBBox()).filter((b) => b.x < 0 || b.x + b.width > 900).length""")
    assert outside == 0
    shot(page, artifacts, "dashboard-progress", full_page=True)
    Path(gate).touch()
    wait_for(lambda: int(bar.get_attribute("data-finished") or 0) > part, 20, "progress to advance")
    client.gather(futures, timeout=30)
    wait_for(lambda: bar.get_attribute("data-finished") == "16", 10, "the bar to fill")
    assert "succeeded" in row.inner_text()


def test_a_failed_task_shows_its_error_as_text(live, artifacts):
    mesh, page, _ = live
    client = mesh.clients[0]
    (future,) = client.submit_calls(explode, [((7,), {})], job="failjob", name="explodes")
    with pytest.raises(Exception, match="boom 7"):
        future.result(timeout=30)
    page.locator('#failures li[data-task]').first.wait_for()
    assert "ValueError: boom 7" in page.locator("#failures li[data-task]").first.inner_text()
    page.locator('#jobs tr[data-job="failjob"]').click()
    task_row = page.locator("#tasks tr.task-failed")
    task_row.wait_for()
    assert "ValueError: boom 7: <b>not bold</b>" in task_row.inner_text()  # shown, not rendered
    task_row.click()
    detail = page.locator("#task-error")
    # The whole remote traceback: its start is beyond what the job's status keeps of it.
    wait_for(lambda: "Traceback (most recent call last)" in detail.inner_text(), 10,
             "the whole remote traceback")
    assert "in explode" in detail.inner_text()
    assert page.locator("#task-error b, #tasks b, script:not([src])").count() == 0
    shot(page, artifacts, "dashboard-failure", full_page=True)
    page.locator("#job-close").click()


def test_cancel_from_the_page(live, artifacts):
    mesh, page, _ = live
    client = mesh.clients[0]
    futures = client.submit_calls(pause, [((60,), {}) for _ in range(6)], job="canceljob",
                                  name="long")
    row = page.locator('#jobs tr[data-job="canceljob"]')
    wait_for(lambda: "running" in row.inner_text() if row.count() else False, 20,
             "the long job to run")
    row.locator("button.cancel").click()
    wait_for(lambda: "cancelled" in row.inner_text(), 20, "the job to show cancelled")
    assert all(f.cancelled() or f.exception(timeout=10) for f in futures)
    # One line for the burst (queued tasks at once, running ones a moment later), and who asked.
    events = page.locator("#events")
    wait_for(lambda: "6 tasks cancelled in job canceljob" in events.inner_text(), 10,
             "the burst as one line")
    assert events.inner_text().count("cancelled in job canceljob") == 1
    assert "job canceljob cancelled by " in events.inner_text()
    shot(page, artifacts, "dashboard-cancelled", full_page=True)


def test_cancel_of_another_owners_job_asks_in_page_terms(live, monkeypatch):
    mesh, page, _ = live
    monkeypatch.setenv("LOGNAME", "bob")  # what this client says its owner is (user@host)
    bob = mesh.client()
    futures = bob.submit_calls(pause, [((60,), {}) for _ in range(2)], job="bobsjob", name="bobs")
    monkeypatch.undo()
    asked: list[str] = []

    def answer(dialog: Any) -> None:
        asked.append(dialog.message)
        dialog.accept()

    page.on("dialog", answer)
    try:
        row = page.locator('#jobs tr[data-job="bobsjob"]')
        row.locator("button.cancel").click()
        wait_for(lambda: "cancelled" in row.inner_text(), 20, "the forced cancel")
    finally:
        page.remove_listener("dialog", answer)
    assert len(asked) == 1 and "was submitted by bob@" in asked[0]
    assert "not by you" in asked[0] and "--force" not in asked[0]
    assert all(f.cancelled() or f.exception(timeout=10) for f in futures)


def test_off_loopback_the_page_is_https_and_asks_for_the_token(live, artifacts, tmp_path):
    mesh, page, _ = live
    if shutil.which("openssl") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("openssl is missing: CI installs it")
        pytest.skip("openssl is not installed")
    made = tls.self_signed(tmp_path, "127.0.0.1")
    guarded = Dashboard(mesh.clients[0], mesh.token, port=0,
                        tls=tls.server_context(made.cert, made.key))
    # As bound beyond loopback; the test keeps the socket on loopback (TESTING.md).
    guarded.guard.login_required = True
    guarded.start()
    # The user checked the fingerprint on the warning page; the test trusts it the same way.
    context = page.context.browser.new_context(ignore_https_errors=True)
    try:
        login = context.new_page()
        assert guarded.url.startswith("https://")
        login.goto(guarded.url)
        assert login.url.endswith("/login")
        login.fill("input[name=token]", "not-the-token")
        login.click("button[type=submit]")
        login.wait_for_url("**/login?failed")
        assert "not this mesh's token" in login.inner_text("body")
        login.fill("input[name=token]", mesh.token)
        login.click("button[type=submit]")
        login.wait_for_selector("#conn.live")  # the Secure cookie took, the stream flows
        (cookie,) = context.cookies()
        assert cookie["secure"] and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert mesh.token not in login.content()
        shot(login, artifacts, "dashboard-after-login")
        login.click("#logout")
        login.wait_for_url("**/login")
    finally:
        context.close()
        guarded.close()


def test_drain_from_the_page(live, artifacts):
    mesh, page, _ = live
    page.once("dialog", lambda dialog: dialog.accept())
    card = page.locator("#workers .worker").first
    worker = card.get_attribute("data-worker")
    card.locator("button.drain").click()
    left = page.locator(f'#workers .worker[data-worker="{worker}"] .badge.left')
    left.wait_for(timeout=20_000)
    assert any(e[2] == "worker_control" and e[3]["action"] == "drain"
               for e in mesh.clients[0].events())
    # A departure, not a failure: said so, and counted as left rather than lost.
    assert left.inner_text() == "left (drained)"
    wait_for(lambda: "worker left" in page.locator("#events").inner_text(), 10, "the event")
    assert "lost" not in page.locator("#worker-count").inner_text()
    assert "lost" not in page.locator("#health").inner_text()
    shot(page, artifacts, "dashboard-drained", full_page=True)


def test_a_wrong_token_shows_not_connected_never_live(live, artifacts):
    mesh, page, _ = live
    wrong = Dashboard(mesh.client(token="salt." + "x" * 32), "unused", port=0, interval=0.2)
    wrong.start()
    context = page.context.browser.new_context()
    try:
        other = context.new_page()
        other.goto(wrong.url)
        conn = other.locator("#conn")
        wait_for(lambda: "token does not match" in conn.inner_text(), 20, "the refusal")
        assert "live" not in conn.get_attribute("class")
        assert other.locator("body.stale").count() == 1
        assert "0 alive" not in other.locator("#worker-count").inner_text()
        shot(other, artifacts, "dashboard-wrong-token")
    finally:
        context.close()
        wrong.close()


class Flaky:
    """The live mesh's client, until ``down``: then every round fails as if it were stopped."""

    def __init__(self, client: Any) -> None:
        self.client, self.down = client, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def workers(self) -> Any:
        if self.down:
            raise ConnectionFailed("cannot reach a coordinator at tcp://127.0.0.1:9")
        return self.client.workers()


def test_a_silent_coordinator_greys_the_page_and_says_since_when(live, artifacts):
    mesh, page, _ = live
    flaky = Flaky(mesh.clients[0])
    watched = Dashboard(flaky, mesh.token, port=0, interval=0.2)  # type: ignore[arg-type]
    watched.start()
    context = page.context.browser.new_context()
    try:
        other = context.new_page()
        other.goto(watched.url)
        other.wait_for_selector("#conn.live")
        flaky.down = True
        conn = other.locator("#conn")
        wait_for(lambda: "coordinator not answering since" in conn.inner_text(), 10, "the outage")
        assert other.locator("body.stale").count() == 1
        assert other.locator("#workers .worker").count() >= 1  # the last figures, greyed
        shot(other, artifacts, "dashboard-not-answering")
        flaky.down = False
        other.wait_for_selector("#conn.live", timeout=15_000)  # back by itself
        assert other.locator("body.stale").count() == 0
    finally:
        context.close()
        watched.close()


def test_a_paused_worker_and_then_a_lost_one_show_as_such(live, gpu_worker, artifacts):
    mesh, page, _ = live
    wid = gpu_worker.worker_id
    card = page.locator(f'#workers .worker[data-worker="{wid}"]')
    circle = page.locator(f'#mesh g.node[data-worker="{wid}"] circle')
    # Its owner takes the machine back with the command they would type on it.
    owner = subprocess.run([sys.executable, "-m", "gpumesh", "pause", "--worker", wid],
                           env={**os.environ, **mesh.env}, capture_output=True, text=True,
                           timeout=30)
    assert owner.returncode == 0, owner.stderr
    wait_for(lambda: card.locator(".badge").inner_text() == "paused", 15, "the paused badge")
    assert circle.get_attribute("class") == "state-paused"
    assert " · paused" in (page.locator(f'#mesh g.node[data-worker="{wid}"]').text_content() or "")
    assert card.locator("button.resume").count() == 1 and card.locator("button.drain").count() == 0
    shot(page, artifacts, "dashboard-paused", full_page=True)

    gpu_worker.kill()  # kill -9: a crash, not a departure
    wait_for(lambda: card.locator(".badge").inner_text() == "lost", 20, "the lost badge")
    assert circle.get_attribute("class") == "state-lost"
    assert " · lost" in (page.locator(f'#mesh g.node[data-worker="{wid}"]').text_content() or "")
    assert card.locator("button").count() == 0  # nothing to steer on a worker that is gone
    assert "1 lost" in page.locator("#worker-count").inner_text()
    # Its last load figures are not shown as if they were live.
    assert card.locator(".bar").count() == 0
    assert "not connected: no live load figures" in card.inner_text()
    # Traffic is labelled on edges of work only: an idle mesh's heartbeats get no label.
    wait_for(lambda: page.locator("#mesh text.edge-label").count() == 0, 10,
             "no traffic labels on an idle mesh")
    wait_for(lambda: "worker lost · gpubox" in page.locator("#events").inner_text(), 10,
             "the lost event")
    shot(page, artifacts, "dashboard-lost", full_page=True)


@pytest.mark.slow
def test_a_new_user_follows_a_thousand_task_map_on_three_workers(browser, artifacts, tmp_path):
    mesh = Mesh(tmp_path)
    dashboard = context = None
    runs = ThreadPoolExecutor(1)
    try:
        mesh.start_coordinator()
        for _ in range(3):
            mesh.add_worker(slots=2)
        client = mesh.client()
        ids = {w["id"] for w in mesh.wait_workers(3, client)}
        dashboard = Dashboard(client, mesh.token, port=0, interval=0.5)
        dashboard.start()
        context = browser.new_context(viewport={"width": 1600, "height": 1100})
        page = context.new_page()
        # Every worker the page ever draws busy, in its list and in its picture, between
        # the test's looks at it.
        page.add_init_script("""
            window.busy = {cards: new Set(), nodes: new Set()};
            setInterval(() => {
              for (const c of document.querySelectorAll("#workers .worker:has(.badge.busy)"))
                window.busy.cards.add(c.dataset.worker);
              for (const n of document.querySelectorAll("#mesh g.node:has(circle.state-busy)"))
                window.busy.nodes.add(n.dataset.worker);
            }, 20);
        """)
        results = runs.submit(client.map, pause, [0.05] * 1000, timeout=300)
        page.goto(dashboard.url)  # opened while the .map runs
        page.wait_for_selector("#conn.live")
        bar = page.locator("#jobs tbody tr .progress")
        bar.wait_for(timeout=20_000)
        assert bar.get_attribute("data-total") == "1000"
        wait_for(lambda: 0 < int(bar.get_attribute("data-finished") or 0) < 1000, 60,
                 "the job part-way through")
        shot(page, artifacts, "dashboard-map-running", full_page=True)
        assert results.result(timeout=300) == [0.05] * 1000
        wait_for(lambda: bar.get_attribute("data-finished") == "1000", 20, "1000/1000 on the page")
        row = page.locator("#jobs tbody tr").first
        assert "1000 done" in row.inner_text() and "succeeded" in row.inner_text()
        busy = page.evaluate("({cards: [...busy.cards], nodes: [...busy.nodes]})")
        assert set(busy["cards"]) == ids and set(busy["nodes"]) == ids
        # A thousand successes are in the throughput chart, not in the events list.
        events = page.locator("#events li")
        assert page.locator('#events li[data-kind="task_finished"]').count() == 0
        assert 0 < events.count() <= 10 and " done in job" not in page.inner_text("#events")
        shot(page, artifacts, "dashboard-map-done", full_page=True)
    finally:
        runs.shutdown(wait=False, cancel_futures=True)
        if context is not None:
            context.close()
        if dashboard is not None:
            dashboard.close()
        mesh.close()
