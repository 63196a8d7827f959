"""One engine thread for the whole server; one asyncio queue per request.

  HTTP handler (event loop)  --submit-->  LLMEngine.add_request (locked inbox)
  engine thread: step() -> [RequestOutput] --loop.call_soon_threadsafe--> that request's queue
  HTTP handler             <--RequestHandle.outputs()--  deltas until finished

New requests join the running batch between steps (continuous batching). At most
`max_pending` requests are admitted (running + queued); the next one gets a 503.
"""

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine.llm_engine import LLMEngine, RequestOutput
from ..engine.sampling_params import SamplingParams
from ..errors import KtError
from .errors import bad_request, engine_failed, overloaded, shutting_down
from .metrics import Metrics

IDLE_WAIT_S = 0.5
log = logging.getLogger("kt.server")


@dataclass
class RequestHandle:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise engine_failed(str(item))
            self.finished = item.finished
            yield item

    def deliver(self, item) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics, max_pending: int):
        self.engine, self.metrics, self.max_pending = engine, metrics, max_pending
        self.handles: dict[str, RequestHandle] = {}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.accepting = True
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="kt-engine", daemon=True)

    def start(self) -> None:
        self._update_gauges()
        self.thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        """On the event loop: admit one request or raise an APIError (400, 503)."""
        if not self.accepting:
            raise shutting_down()
        handle = RequestHandle(uuid.uuid4().hex, asyncio.get_running_loop())
        with self.lock:
            if len(self.handles) >= self.max_pending:
                raise overloaded(self.max_pending)
            self.handles[handle.request_id] = handle
            self.metrics.in_flight = len(self.handles)
        try:
            self.engine.add_request(prompt_ids, params, handle.request_id)
        except KtError as err:
            self._drop(handle.request_id)
            raise bad_request(str(err), "prompt") from None
        self.wake.set()
        return handle

    def abort(self, handle: RequestHandle) -> None:
        if not handle.finished:
            self.engine.abort(handle.request_id)
            self.wake.set()

    def begin_shutdown(self, grace_s: float) -> None:
        """Refuse new requests; those in flight get grace_s seconds to finish, then are aborted
        (their streams end with finish_reason 'abort')."""
        self.accepting = False
        timer = threading.Timer(grace_s, self._abort_all)
        timer.daemon = True
        timer.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Refuse new requests, abort those in flight, let the thread free their blocks and end."""
        self.accepting = False
        self._abort_all()
        self.stopping = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _abort_all(self) -> None:
        with self.lock:
            pending = list(self.handles)
        for request_id in pending:
            self.engine.abort(request_id)
        self.wake.set()

    def _run(self) -> None:
        while True:
            self.wake.clear()
            if not self.engine.has_unfinished():
                if self.stopping:
                    return
                self.wake.wait(IDLE_WAIT_S)
                continue
            try:
                outputs = self.engine.step()
            except Exception as err:  # a model bug must fail its requests, not kill the server
                log.exception("engine step failed")
                self._fail_all(err)
                continue
            self._dispatch(outputs)
            self._update_gauges()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.new_token_ids:
                self.metrics.count_tokens(len(out.new_token_ids))
            if out.finished:
                self.metrics.count_finished(out.num_prompt_tokens, out.num_cached_tokens)
                handle = self._drop(out.request_id)
            else:
                handle = self.handles.get(out.request_id)
            if handle is not None:
                handle.deliver(out)

    def _fail_all(self, err: Exception) -> None:
        with self.lock:
            failed = list(self.handles.values())
            self.handles.clear()
            self.metrics.in_flight = 0
        for handle in failed:
            self.engine.abort(handle.request_id)
            handle.deliver(err)

    def _drop(self, request_id: str) -> RequestHandle | None:
        with self.lock:
            handle = self.handles.pop(request_id, None)
            self.metrics.in_flight = len(self.handles)
        return handle

    def _update_gauges(self) -> None:
        gauges, scheduler, blocks = self.metrics.engine, self.engine.scheduler, self.engine.block_manager
        gauges.waiting, gauges.running = len(scheduler.waiting), len(scheduler.running)
        gauges.kv_blocks_total, gauges.kv_blocks_free = blocks.num_blocks, blocks.num_free_blocks
        gauges.restored_blocks = getattr(blocks, "num_restored_blocks", 0)
        gauges.preemptions = scheduler.num_preemptions
