"""What waking a request's reader costs the event loop, per token: 256 readers each woken once a step, 400
steps, under uvloop, with an `asyncio.Event` (set, wait, clear) and with a flag and one future
(`request_stream.RequestStream.wake` / `wait`).

    python lab/stream_wake_bench.py
"""
import asyncio, time, uvloop
N, STEPS = 256, 400
class S:
    __slots__=("changed","waiter")
    def __init__(self): self.changed=False; self.waiter=None
    def wake(self):
        self.changed=True; w=self.waiter
        if w is not None and not w.done(): w.set_result(None)
    async def wait(self, loop):
        if not self.changed:
            self.waiter=loop.create_future(); await self.waiter
        self.changed=False
async def run(kind):
    loop=asyncio.get_running_loop()
    streams=[asyncio.Event() if kind=="event" else S() for _ in range(N)]
    async def reader(s):
        for _ in range(STEPS):
            if kind=="event":
                await s.wait(); s.clear()
            else:
                await s.wait(loop)
    tasks=[asyncio.ensure_future(reader(s)) for s in streams]
    await asyncio.sleep(0)
    t=time.perf_counter()
    for _ in range(STEPS):
        for s in streams: (s.set() if kind=="event" else s.wake())
        await asyncio.sleep(0); await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return (time.perf_counter()-t)/(N*STEPS)*1e6
for r in range(3):
    for kind in ("event","future"):
        print(kind, "%.2f us/wake"%uvloop.run(run(kind)))
