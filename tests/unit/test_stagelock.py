"""The cross-instance isolation lock (bls_models/stagelock.py): readers share it, a writer
waits for the readers already out and holds new ones back, every wait ends at its deadline, and
separate file descriptions exclude each other within one process as across processes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

from bls_models.stagelock import StageLock


def lock(tmp_path, key="repo/pipeline"):
    return StageLock(key, "classifier", directory=tmp_path)


def test_readers_share_it(tmp_path):
    a, b = lock(tmp_path), lock(tmp_path)
    with a.shared(time.monotonic() + 1) as first, b.shared(time.monotonic() + 1) as second:
        assert first and second


def test_a_writer_waits_for_the_reader_already_out_then_has_the_stage(tmp_path):
    reader, writer = lock(tmp_path), lock(tmp_path)
    out, back = threading.Event(), threading.Event()
    events = []

    def sub_request():
        with reader.shared(time.monotonic() + 5) as held:
            assert held
            out.set()
            time.sleep(0.2)
            events.append("reader back")
        back.set()

    async def isolate():
        async with writer.exclusive(time.monotonic() + 5) as held:
            events.append(("writer", held))

    thread = threading.Thread(target=sub_request)
    thread.start()
    out.wait(5)
    asyncio.run(isolate())
    thread.join(5)
    assert events == ["reader back", ("writer", True)]


def test_while_a_writer_holds_it_readers_wait_and_give_up_at_their_deadline(tmp_path):
    writer, reader = lock(tmp_path), lock(tmp_path)
    seen = []

    async def scenario():
        async with writer.exclusive(time.monotonic() + 5) as held:
            assert held
            started = time.monotonic()
            # Every sub-request taking it shared waits — this process's too (its isolation's
            # re-sends do not take it: SubRequests.send(isolating=True)) — and gives up in time.
            own = await asyncio.to_thread(_shared, writer, started + 0.1)
            seen.append(("own", own))
            started = time.monotonic()
            done = await asyncio.to_thread(_shared, reader, started + 0.1)
            seen.append(("other", done, time.monotonic() - started))
        # Released: the other instance gets in.
        seen.append(("after", await asyncio.to_thread(_shared, reader, time.monotonic() + 1)))

    asyncio.run(scenario())
    (_, own), (_, other, waited), (_, after) = seen
    assert own is False and other is False and after is True
    assert 0.1 <= waited < 0.1 + 0.25  # support.SLACK


def test_a_writer_gives_up_at_its_deadline_while_another_process_holds_it_shared(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from bls_models.stagelock import StageLock\n"
         "lock = StageLock('repo/pipeline', 'classifier', directory=Path(sys.argv[1]))\n"
         "with lock.shared(time.monotonic() + 30) as held:\n"
         "    print(held, flush=True); sys.stdin.readline()\n", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "True"

        async def isolate(limit):
            async with lock(tmp_path).exclusive(time.monotonic() + limit) as held:
                return held

        assert asyncio.run(isolate(0.1)) is False
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(10)
        assert asyncio.run(isolate(5)) is True
    finally:
        holder.kill()
        holder.wait()


def test_other_orchestrators_and_stages_have_their_own(tmp_path):
    async def both():
        async with lock(tmp_path).exclusive(time.monotonic() + 1) as first:
            async with lock(tmp_path, key="repo/tag_pipeline").exclusive(
                    time.monotonic() + 1) as second:
                return first, second

    assert asyncio.run(both()) == (True, True)


def _shared(stage_lock: StageLock, expires: float) -> bool:
    with stage_lock.shared(expires) as held:
        return held
