"""CompiledArtifact: a multi-variant compiled graph that dispatches each call by shape."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from precompile.cache import (
    StoredEntry,
    TrustedKeysOption,
    cache_to_read,
    remove_abandoned_temps,
    resolve_trusted_keys,
    sha256_hex,
)

from . import _native_kernels as native_kernels
from . import _torch_adapter as adapter
from ._binary_format import read_binary, write_binary
from ._calibration import (
    SizesSpec,
    Timer,
    default_timer,
    measure,
    normalize_sizes,
    synthesize_inputs,
)
from ._contract import (
    InputContract,
    Prepared,
    check_indices,
    index_checks,
    input_label,
    kernel_index_failure,
    label_index,
    name_inputs,
)
from ._cudagraphs import (
    CAPTURE_LOCK,
    CudaGraphExecutor,
    CudaGraphs,
    CudaGraphsOption,
    cudagraph_options,
)
from ._dispatch import Dispatcher, Explanation
from ._environment import check_compatible, current_environment
from ._errors import (
    ArtifactNotFoundError,
    CacheWriteError,
    CorruptArtifactError,
    IncompatibleArtifactError,
    IndexOutOfRangeError,
    InvalidOptionError,
    PrecompileError,
)
from ._execution import DirectExecutor, Executor
from ._lean import lean_enabled, load_lean
from ._manifest import Calibration, Manifest, Symbol, TensorInput, Variant
from ._payloads import LazyPayloads, OverlayPayloads, PayloadStore
from ._process_groups import check_groups
from ._relocate import RelocationRefused, artifact_device_index, relocate
from ._unpacked_format import read_unpacked, write_unpacked
from ._warmup import WarmUpSchedule
from ._warmup import exiting as _exiting

log = logging.getLogger("precompile.runtime")


OutputStructure = Literal["upstream", "graph"]
_OUTPUT_STRUCTURES = ("upstream", "graph")


def _as_list(flat: Any) -> Any:
    return flat if type(flat) is list else list(flat)


def _output_unflattener(manifest: Manifest, flat: bool = False) -> Callable[[Any], Any] | None:
    """How a call's flat outputs are handed back: the graph's output structure (what
    upstream's compiling process returns: a list for a graph returning a tuple, the
    value or pytree otherwise), or, ``flat``, the list upstream's loaded artifacts return
    whatever the graph's structure."""
    if flat:
        return _as_list
    if manifest.output is None:
        return None
    try:
        return adapter.output_unflattener(manifest.output)
    except Exception as exc:  # upstream's spec reader raises assorted errors on bad input
        raise CorruptArtifactError(
            f"manifest field output is not a pytree spec this torch reads ({exc})"
        ) from None


def _usable_calibration(manifest: Manifest) -> Calibration | None:
    """The artifact's dispatch table if it was measured on a device named like this one."""
    table = manifest.calibration
    if table is None:
        return None
    try:
        here = current_environment(manifest.environment.device_type).device_name
    except (RuntimeError, AssertionError) as exc:
        here = f"unavailable ({exc})"
    if here != table.device_name:
        log.warning(
            "ignoring the artifact's calibration table: it was measured on %r, this device "
            "is %r; dispatch falls back to the nearest-hint heuristic",
            table.device_name,
            here,
        )
        return None
    return table


# Every artifact of this process, so that a forked child can reset what a thread of its
# parent may have held at the fork (a lock, a warm-up thread that does not exist there).
_live: weakref.WeakSet[CompiledArtifact] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for artifact in list(_live):
        artifact._lock = threading.RLock()
        artifact._warm_up.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclasses.dataclass(frozen=True)
class SaveInfo:
    """What ``save`` writes, in the shape of upstream's ``CacheInfo`` that clients read."""

    aot_autograd_artifacts: tuple[str, ...]


_UNCHECKED = object()
ArtifactFormat = Literal["binary", "unpacked"]
_FORMATS = ("binary", "unpacked")
DEFAULT_MEMO_SIZE = 4096


def _check_format(format: str) -> None:
    if format not in _FORMATS:
        raise InvalidOptionError(f"format must be 'binary' or 'unpacked', got {format!r}")


class CompiledArtifact:
    """Call it like the graph (flat inputs, SymInt placeholders as ints); save it; load it.

    Each call reads the symbols' sizes from the inputs, checks the inputs against the
    graph's contract, and runs the variant chosen for those sizes (memoized per size
    tuple). Variants load on first use; ``warmup()`` loads them all ahead.
    """

    def __init__(
        self,
        manifest: Manifest,
        payloads: PayloadStore,
        *,
        loaded: Mapping[str, Callable[..., Any]] | None = None,
        memo_size: int = DEFAULT_MEMO_SIZE,
        cudagraphs: CudaGraphsOption = None,
    ) -> None:
        if manifest.moved_from is not None and not lean_enabled():
            raise IncompatibleArtifactError(
                f"this artifact was moved from cuda:{manifest.moved_from} (to()) and runs its "
                "lean variants only: PRECOMPILE_LEAN=0 turns them off"
            )
        upstream = [v.index for v in manifest.variants if v.lean is None or not lean_enabled()]
        if upstream:
            # The torch compiler modules that loading and running such a variant import
            # (1-2 s on a CPU, 5-10 s on a GPU host): paid here, once, so that its first
            # call has the short latency a server's first request needs. Lean variants
            # import none of them.
            log.info(
                "variants %s load through upstream's path, importing torch's compiler: %s",
                upstream,
                "PRECOMPILE_LEAN=0"
                if not lean_enabled()
                else "the artifact has no lean call for them (its build logged why)",
            )
            adapter.import_runtime_modules()
        self._manifest = manifest
        self._payloads = payloads
        self._contract = InputContract(manifest)
        self._unflatten = _output_unflattener(manifest)
        self._executor: Executor = DirectExecutor()
        self._templates: Sequence[Any] | None = None
        self._runnable: Callable[[Mapping[str, int]], bool] | None = None
        self._dispatcher = Dispatcher(manifest, _usable_calibration(manifest))
        self._callables: dict[str, Callable[..., Any]] = dict(loaded or {})
        self._memo: dict[tuple[int, ...], Callable[..., Any]] = {}
        self._memo_size = max(1, memo_size)
        self._lock = threading.RLock()
        # The key an ArtifactCache stored or found it under (set by the cache), for tagging.
        self.cache_key: str | None = None
        self._warm_up = WarmUpSchedule()  # when a background warm-up runs
        # the process groups of its collectives, checked before its first run here
        # the default group the process groups were checked under (another object, or
        # None, after destroy_process_group or a new init: checked again)
        self._groups_world: Any = _UNCHECKED
        self._index_checks = index_checks(manifest)
        _live.add(self)
        self.set_cudagraphs(manifest.cudagraphs if cudagraphs is None else cudagraphs)

    def require_traced_grad_flags(self) -> None:
        """Refuse calls whose tensors' ``requires_grad`` differs from the trace's, under
        ``no_grad`` too (a compiled model's: its forward's Python may have read them)."""
        with self._lock:
            self._contract.require_traced_grad_flags()

    # -- calling ---------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        key = self._contract.read_key(args)
        if key is None:
            return self._call_prepared(self._contract.coerce(args))
        function = self._memo.get(key)
        if function is None:
            return self._first_call(key, args)
        try:
            result = function(*args)
        except AssertionError as exc:
            raise self._refused_by_code(key, exc) from exc
        return result if self._unflatten is None else self._unflatten(result)

    def _refused_by_code(self, key: tuple[int, ...], exc: AssertionError) -> CorruptArtifactError:
        """Inductor's code checks its inputs' sizes and strides (``assert_size_stride``):
        a call it refuses passed the artifact's guards for the variant they chose, so the
        guards admit what the code was not compiled for (a manifest edited, with its
        digests recomputed: a client trial widened a variant's guards)."""
        try:
            where = f"variant {self._dispatcher.choose(key)}"
        except Exception:
            where = "the variant"
        return CorruptArtifactError(
            f"{where}'s compiled code refused this call's inputs ({exc}), which the "
            "artifact's guards admit: its manifest does not describe its code"
        )

    def _first_call(self, key: tuple[int, ...], args: Sequence[Any]) -> Any:
        """A call at sizes not seen yet: it may load its variant and pays first-run costs,
        so a background warm-up gives way (between its steps) until it is done."""
        with self._warm_up.foreground():
            function = self._resolve(key)
            try:
                result = function(*args)
            except AssertionError as exc:
                raise self._refused_by_code(key, exc) from exc
        self._warm_up.called.set()
        return result if self._unflatten is None else self._unflatten(result)

    def _call_prepared(self, prepared: Prepared) -> Any:
        """A call whose inputs needed the slow path (and maybe copies into the compiled
        layout, written back after the call where the graph writes them)."""
        function = self._memo.get(prepared.key)
        if function is None:
            with self._warm_up.foreground():
                function = self._resolve(prepared.key)
        try:
            result = function(*prepared.args)
        except AssertionError as exc:
            raise self._refused_by_code(prepared.key, exc) from exc
        if not self._warm_up.called.is_set():
            self._warm_up.called.set()
        for target, source in prepared.writebacks:
            target.copy_(source)
        return result if self._unflatten is None else self._unflatten(result)

    def trusting_caller(self) -> Callable[..., Any]:
        """A callable that runs this artifact without checking its inputs, only reading
        their sizes to dispatch: for callers that already enforce the whole input contract
        (dtypes, devices, sizes, strides, grad mode), as Dynamo's guards do for the
        graphs it hands ``precompile.backend``. Its per-call cost does not grow with the
        number of inputs. Anyone else should call the artifact itself."""
        trusted_key = self._contract.trusted_key
        memo = self._memo
        first_call = self._first_call
        refused_by_code = self._refused_by_code
        unflatten = self._unflatten

        def call_trusted(*args: Any) -> Any:
            key = trusted_key(args)
            function = memo.get(key)
            if function is None:
                return first_call(key, args)
            try:
                result = function(*args)
            except AssertionError as exc:
                raise refused_by_code(key, exc) from exc
            return result if unflatten is None else unflatten(result)

        call_trusted.artifact = self  # type: ignore[attr-defined]
        return call_trusted

    def _check_process_groups(self) -> None:
        """Before this process runs the graph's collectives: the groups they name exist
        here as they were compiled for (a local check, no collective). Checked again once
        the default group is another (destroyed, or made anew): a call after
        ``destroy_process_group()`` had reached the collective itself."""
        if not self._manifest.process_groups:
            return
        world = adapter.default_process_group()
        if world is None or world is not self._groups_world:
            check_groups(self._manifest.process_groups, "this artifact")
            self._groups_world = world

    def _checking_groups(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` behind an identity check of the default group, per call."""

        def checked(*args: Any) -> Any:
            if adapter.default_process_group() is not self._groups_world:
                self._check_process_groups()
            return function(*args)

        return checked

    def _resolve(self, key: tuple[int, ...]) -> Callable[..., Any]:
        with self._lock:
            function = self._memo.get(key)
            if function is not None:
                return function
            self._check_process_groups()
            index = self._dispatcher.choose(key)
            variant = self._variant_callable(self._manifest.variants[index])
            function = self._executor.runner(key, index, variant)
            if self._manifest.process_groups:
                function = self._checking_groups(function)
            if len(self._memo) >= self._memo_size:
                del self._memo[next(iter(self._memo))]
            self._memo[key] = function
            log.debug("sizes %s -> variant %d", key, index)
            return function

    def _variant_callable(self, variant: Variant) -> Callable[..., Any]:
        with self._lock:
            function = self._callables.get(variant.payload)
            if function is None:
                native_kernels.register(variant.kernels, self._payloads.read)
                function = self._lean_callable(variant)
                moved_from = self._manifest.moved_from
                if function is None and moved_from is not None:
                    raise IncompatibleArtifactError(
                        f"variant {variant.index} cannot run here: this artifact was moved "
                        f"from cuda:{moved_from} (to()), where its inductor code is compiled, "
                        "and runs its lean variants only"
                    )
                if function is None:
                    payload = self._payloads.read(variant.payload)
                    function = adapter.load_variant(
                        payload,
                        forward_source=self._payloads.edited_source(variant.payload),
                        rewrite=native_kernels.redirect_cpp_kernels,
                    )
                if self._index_checks or variant.kernels:
                    function = _with_index_checks(function, self._index_checks, self.inputs)
                self._callables[variant.payload] = function
            return function

    def _lean_callable(self, variant: Variant) -> Callable[..., Any] | None:
        """The variant run directly (see ``_lean``), or None where it has no lean call or
        its code imports a compiler module after all (then upstream's path runs it)."""
        lean = variant.lean
        if lean is None or not lean_enabled():
            return None
        source = self._payloads.read(lean.source).decode("utf-8")
        try:
            return load_lean(lean, source, f"variant_{variant.payload[:16]}", self._payloads.read)
        except adapter.LeanImportRefused as exc:
            log.warning("variant %d loads through upstream's path: %s", variant.index, exc)
            adapter.import_runtime_modules()
            return None

    @property
    def payload_store(self) -> PayloadStore:
        """Where this artifact's payloads come from (a compiled model's pieces share it)."""
        return self._payloads

    def has_payload(self, digest: str) -> bool:
        return self._payloads.has(digest)

    def payload_bytes(self, digest: str) -> bytes:
        """The verified bytes of one payload (what a save or a cache writes)."""
        return self._payloads.read(digest)

    def variant_callable(self, index: int) -> Callable[..., Any]:
        """The raw callable of variant ``index`` (no contract check, no dispatch)."""
        return self._variant_callable(self._manifest.variants[index])

    def calibrate(
        self,
        sizes: SizesSpec,
        *,
        device: str | None = None,
        inputs: Sequence[Any] | None = None,
        timer: Timer | None = None,
        warmup: int = 10,
        reps: int = 50,
        rounds: int = 3,
        min_gain: float = 0.05,
    ) -> Calibration:
        """Measure every admissible variant at each of ``sizes`` and dispatch by the result.

        ``sizes``: ints (one symbol), or a tuple / ``{symbol: size}`` per sample. Inputs
        are synthesized from the input specs; ``inputs`` (the graph's flat inputs at any
        size) supplies the tensors whose shape does not change, such as weights. The table
        is kept in the artifact (``save`` writes it) and used only on a device of the same
        name; outside the sampled range the log2 heuristic still decides. On CUDA the
        default timer is ``triton.testing.do_bench`` (``warmup`` and ``reps`` in ms there,
        counts elsewhere). Each of ``rounds`` rounds times every size, the variants taking
        turns, and each variant keeps its median time per size. A measured winner replaces
        the nearest-hint or exact-size choice only where it beat it by more than
        ``min_gain`` (0.05 = 5%): smaller gaps were within an H200's round-to-round noise.
        """
        if self._manifest.process_groups:
            raise InvalidOptionError(
                "calibrate() times each variant a number of times that differs between "
                "ranks, and this graph runs collectives, which every rank must run in the "
                "same order: it would hang; dispatch by the nearest hint instead"
            )
        points = normalize_sizes(self._manifest, sizes)
        target = device or self._manifest.environment.device_type
        device_name = current_environment(target).device_name
        chosen_timer, method = (
            default_timer(target, warmup, reps) if timer is None else (timer, "custom timer")
        )
        # the timed runs draw from generators forked from the caller's, which they leave
        # where they were (a graph with dropout in training draws on each run)
        with torch.random.fork_rng(devices=self._manifest.cuda_indices):
            table = measure(
                self._manifest,
                points,
                lambda index: self._variant_callable(self._manifest.variants[index]),
                self._dispatcher.admits,
                timer=chosen_timer,
                device_name=device_name,
                method=method,
                templates=inputs,
                rounds=rounds,
                min_gain=min_gain,
            )
        with self._lock:
            self._manifest = dataclasses.replace(self._manifest, calibration=table)
            self._dispatcher = Dispatcher(self._manifest, table)
            self._memo.clear()
        for entry in table.entries:
            log.info(
                "calibrated %s: variant %d fastest (%.1f%% ahead of the next)",
                dict(zip(self._manifest.symbol_names, entry.point, strict=True)),
                entry.best,
                entry.margin * 100,
            )
        return table

    def warmup(
        self,
        *,
        background: bool = False,
        inputs: Sequence[Any] | None = None,
        runnable: Callable[[Mapping[str, int]], bool] | None = None,
    ) -> CompiledArtifact:
        """Load every variant now, so no call pays a first-use cost. With ``inputs`` (the
        graph's flat inputs at any size; tensors of a fixed shape, such as weights, are
        used as given, copies of those the graph writes in place, the rest made up), also
        run each variant once at its own point, and with CUDA graphs and
        ``capture_sizes``, capture those. Nothing of ``inputs`` is written.

        With ``background=True`` a thread does it while this thread goes on
        (a server can take requests meanwhile; a call that needs a variant still being
        loaded waits for it, and a size not yet captured runs plainly). The thread begins
        once the first call has returned, or after ``$PRECOMPILE_WARMUP_GRACE`` seconds
        (default 1) without one, so a first request is not queued behind it. ``wait_warm()``
        joins that thread and re-raises its error. ``runnable(point)``: run a variant at
        its point only where it says so (the others are only loaded).
        """
        if inputs is not None:
            self._templates = list(inputs)
        if runnable is not None:
            self._runnable = runnable
        if not background:
            self._warm(in_background=False)
            return self
        self._warm_up.start(lambda: self._warm(in_background=True))
        return self

    def _warm(self, *, in_background: bool) -> None:
        """Load every variant; run each once and capture ``capture_sizes`` where that is
        safe. A graph with collectives is never run by warm-up: its runs would be
        collectives that the other ranks do not make at that moment (and a background
        thread's would interleave with the calling thread's). A foreground warm-up still
        captures, since every rank captures the same sizes in the same order. Nor is a
        graph that draws random numbers: its runs would move the caller's generator."""
        collectives = bool(self._manifest.process_groups)
        draws = self._manifest.draws_random
        for variant in self._manifest.variants:
            self._warm_up.give_way()
            if _exiting():
                return
            with CAPTURE_LOCK:  # never while another thread captures a CUDA graph
                self._variant_callable(variant)
        if collectives or draws:
            why = "has collectives" if collectives else "draws from the caller's generator"
            log.info("warm-up loaded the variants and ran none: the graph %s", why)
        elif self._templates is not None:
            self._run_each_variant()
        executor = self._executor
        if (
            isinstance(executor, CudaGraphExecutor)
            and executor.options.capture_sizes
            and self._templates is not None
            and not (collectives and in_background)
        ):
            self.capture()

    def _run_each_variant(self) -> None:
        """Run every variant once at its own point, on inputs made from the templates:
        what a first run does lazily (kernel modules loaded onto the device, library
        handles and heuristics) is then done before a request needs it."""
        with torch.no_grad():
            by_size = sorted(self._manifest.variants, key=lambda v: sum(v.point.values()))
            for variant in by_size:  # cheapest first: a request waits at most one step
                self._warm_up.give_way()
                if _exiting():
                    return
                point = tuple(variant.point[n] for n in self._manifest.symbol_names)
                if self._runnable is not None and not self._runnable(variant.point):
                    continue
                try:
                    with CAPTURE_LOCK:  # never while another thread captures a CUDA graph
                        args = synthesize_inputs(self._manifest, point, self._templates)
                        self._variant_callable(variant)(*args)
                except Exception as exc:  # warm-up never fails a server; calls still work
                    log.warning("warm-up run of variant %d failed: %s", variant.index, exc)

    # -- CUDA graphs -----------------------------------------------------------------
    def set_cudagraphs(
        self, cudagraphs: CudaGraphsOption, *, save: bool = False
    ) -> CompiledArtifact:
        """Run calls in this process from CUDA graphs captured per size (see
        ``CudaGraphs``), or not (False). ``save`` writes the artifact's own default (the
        compile's ``cudagraphs=``) unless ``save=True`` makes this the new default: a
        serving-time switch leaves what is saved alone."""
        options = cudagraph_options(cudagraphs)
        with self._lock:
            if options is None:
                self._executor = DirectExecutor()
            else:
                executor = CudaGraphExecutor(self._manifest, options)
                if options.capture_sizes:
                    executor.first_call = self._capture_on_first_call
                self._executor = executor
            if save:
                stored = None if options is None else options.to_json()
                self._manifest = dataclasses.replace(self._manifest, cudagraphs=stored)
            self._memo.clear()
        return self

    @property
    def cudagraphs(self) -> CudaGraphs | None:
        executor = self._executor
        return executor.options if isinstance(executor, CudaGraphExecutor) else None

    @property
    def captured_sizes(self) -> tuple[tuple[int, ...], ...]:
        """The size tuples a CUDA graph is captured for, in this process."""
        executor = self._executor
        return executor.captured if isinstance(executor, CudaGraphExecutor) else ()

    def _capture_on_first_call(self, args: Sequence[Any]) -> None:
        if self._templates is None:
            self._templates = list(args)
            self.capture()

    def capture(
        self, sizes: SizesSpec | None = None, *, inputs: Sequence[Any] | None = None
    ) -> tuple[tuple[int, ...], ...]:
        """Capture CUDA graphs now at ``sizes`` (default: the options' ``capture_sizes``),
        largest first so that smaller graphs reuse the pool, then check padding, if any,
        against an unpadded run. ``inputs`` as for ``warmup``. Returns the sizes captured."""
        executor = self._executor
        if not isinstance(executor, CudaGraphExecutor):
            raise InvalidOptionError("capture() needs cudagraphs on (set_cudagraphs(True))")
        if inputs is not None:
            self._templates = list(inputs)
        wanted = sizes if sizes is not None else executor.options.capture_sizes
        if not wanted or executor.reason is not None:
            return ()
        points = normalize_sizes(self._manifest, wanted, what="capture size")
        self._check_process_groups()
        with torch.no_grad():
            for point in sorted(points, key=lambda p: (-sum(p), p)):
                if _exiting():
                    return ()
                chosen = self._dispatcher.explain(point).chosen
                if chosen is None:  # e.g. size 1, which Dynamo serves with a static graph
                    log.info("capture size %s: no variant admits it; not captured", point)
                    continue
                args = synthesize_inputs(self._manifest, point, self._templates)
                function = self._variant_callable(self._manifest.variants[chosen])
                executor.graph_for(point, function, args)
            executor.verify_padding(self._plain_run, self._padded_replay)
        return tuple(p for p in points if p in executor.captured)

    def _plain_run(self, sizes: tuple[int, ...]) -> tuple[list[Any], list[Any]] | None:
        """A run at ``sizes`` without graphs (None where no variant admits them)."""
        chosen = self._dispatcher.explain(sizes).chosen
        if chosen is None:
            return None
        args = synthesize_inputs(self._manifest, sizes, self._templates)
        return args, list(self._variant_callable(self._manifest.variants[chosen])(*args))

    def _padded_replay(self, sizes: tuple[int, ...], args: list[Any]) -> Any:
        executor = self._executor
        assert isinstance(executor, CudaGraphExecutor)
        target = executor.padded_target(sizes)
        assert target is not None  # verify_padding picks sizes below a captured one
        function = self._variant_callable(self._manifest.variants[self._dispatcher.choose(sizes)])
        return executor.padded_call(sizes, target, function, args)

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Wait for a background warm-up; True when every variant is loaded."""
        self._warm_up.wait(timeout)
        return len(self.loaded_variants) == len(self._manifest.variants)

    @property
    def loaded_variants(self) -> tuple[int, ...]:
        """Indices of the variants whose compiled code is loaded in this process."""
        return tuple(v.index for v in self._manifest.variants if v.payload in self._callables)

    def _sizes(self, args: tuple[Any, ...]) -> tuple[int, ...]:
        """The sizes a call with ``args`` dispatches on; raises where the inputs break the
        contract. Grad mode is the call's, not the inputs': it is not judged here."""
        with torch.no_grad():
            key = self._contract.read_key(args)
            return self._contract.coerce(args, copy=False).key if key is None else key

    def sizes_of(self, *args: Any) -> dict[str, int]:
        key = self._sizes(args)
        return dict(zip(self._manifest.symbol_names, key, strict=True))

    def explain(self, *args: Any) -> Explanation:
        """Which variant these inputs would run, each variant's distance, failing guards."""
        key = self._sizes(args)
        return self._dispatcher.explain(key)

    def excluding(self, guard: str) -> CompiledArtifact:
        """The same variants, each also guarded by ``guard`` (a size they must not serve:
        ``"s77 != 1"``), sharing this artifact's payloads and loaded code."""
        variants = tuple(
            dataclasses.replace(v, guards=(*v.guards, guard)) for v in self._manifest.variants
        )
        manifest = dataclasses.replace(self._manifest, variants=variants, calibration=None)
        return CompiledArtifact(manifest, self._payloads, loaded=self._callables)

    def variant_for(self, *args: Any) -> int:
        """Index of the variant a call with these inputs runs (raises like a call would)."""
        key = self._sizes(args)
        return self._dispatcher.choose(key)

    # -- description -----------------------------------------------------------------
    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def inputs(self) -> tuple[str, ...]:
        """What each flat input is in the caller's code, in call order (``L['x']``,
        ``L['self']._modules['fc']._parameters['weight']``; ``input N`` where the
        artifact records no name: one compiled before names were recorded)."""
        return tuple(
            spec.name or f"input {index}" for index, spec in enumerate(self._manifest.inputs)
        )

    @property
    def symbols(self) -> tuple[Symbol, ...]:
        return self._manifest.symbols

    @property
    def variants(self) -> tuple[Variant, ...]:
        return self._manifest.variants

    def __repr__(self) -> str:
        names = ", ".join(self._manifest.symbol_names) or "static"
        kinds = [v.kind for v in self.variants]
        return (
            f"<precompile.CompiledArtifact symbols=({names}) variants={len(kinds)} "
            f"(hint={kinds.count('hint')}, static={kinds.count('static')}) "
            f"payloads={len(self._manifest.graph_digests)} "
            f"kernels={len(self._manifest.kernel_digests)} "
            f"device={self._manifest.environment.device_type}>"
        )

    # -- another device ----------------------------------------------------------------
    def to(self, device: str | torch.device | int) -> CompiledArtifact:
        """This artifact on another CUDA device of the same GPU model: one compile, one
        file, every tensor-parallel rank on its own device (``art.to(f"cuda:{rank}")``).

        Its lean variants' code and Triton launches are moved to ``device``'s index (see
        ``_relocate``); an artifact whose code names its device in a way not read there,
        or with a variant that has no lean call, is refused with
        ``IncompatibleArtifactError`` naming why (compile on that device instead). A moved
        artifact saves as one (format 6): it runs its lean variants only, never the
        inductor code compiled for the first device. A CPU artifact asked for ``"cpu"``
        is returned as it is."""
        target: torch.device | None = None
        try:
            if not isinstance(device, bool) and isinstance(device, (str, int, torch.device)):
                as_int = isinstance(device, int)
                target = torch.device("cuda", device) if as_int else torch.device(device)
        except (TypeError, RuntimeError, ValueError):
            target = None  # refused below, naming what was passed
        cpu = all(s.device == "cpu" for s in self._manifest.inputs if isinstance(s, TensorInput))
        if target is not None and target.type == "cpu" and target.index in (None, 0) and cpu:
            return self  # a CPU artifact is where it is asked to be
        if target is None or target.type != "cuda" or target.index is None:
            raise InvalidOptionError(
                f"to() takes a CUDA device with an index ('cuda:1'), got {device!r}"
            )
        try:
            old = artifact_device_index(self._manifest)
        except RelocationRefused as exc:
            raise IncompatibleArtifactError(f"cannot move to {target}: {exc}") from None
        if target.index == old:
            return self
        if target.index >= torch.cuda.device_count():
            raise InvalidOptionError(
                f"to({str(target)!r}): this process sees {torch.cuda.device_count()} CUDA devices"
            )
        environment = self._manifest.environment
        name = torch.cuda.get_device_name(target.index)
        capability = "{}.{}".format(*torch.cuda.get_device_capability(target.index))
        if (name, capability) != (environment.device_name, environment.capability):
            raise IncompatibleArtifactError(
                f"this artifact is compiled for {environment.device_name} (capability "
                f"{environment.capability}); {target} is {name} ({capability})"
            )
        try:  # (with PRECOMPILE_LEAN=0 the moved artifact's constructor refuses it)
            manifest, sources = relocate(
                self._manifest, self._payloads.read, target.index, lambda t: sha256_hex(t.encode())
            )
        except RelocationRefused as exc:
            raise IncompatibleArtifactError(f"cannot move to {target}: {exc}") from None
        first = self._manifest.moved_from
        moved = CompiledArtifact(
            dataclasses.replace(manifest, moved_from=old if first is None else first),
            OverlayPayloads(sources, self._payloads),
            memo_size=self._memo_size,
            cudagraphs=self.cudagraphs or False,
        )
        moved._unflatten = self._unflatten
        moved.cache_key = self.cache_key
        log.info("artifact moved from cuda:%d to %s", old, target)
        return moved

    # -- persistence -----------------------------------------------------------------
    @property
    def _artifacts(self) -> tuple[None, SaveInfo]:
        """Upstream's private ``(cache bytes, CacheInfo)`` pair, which vLLM's adaptor reads
        to decide whether an artifact can be saved (one AOTAutograd entry: yes). Ours has no
        mega-cache bytes (None) and one thing to save: this artifact, named by its manifest's
        digest. Kept only for such clients; ``is_saveable()`` is the public question."""
        return None, SaveInfo((self._manifest.digest(),))

    def is_saveable(self) -> bool:
        """Whether ``save`` can write this artifact (upstream's question, asked by clients
        such as vLLM before saving). A precompile artifact holds or references every
        payload it was built or loaded with, and ``save`` verifies each one, so this is
        true; upstream answers false where its compile left no cache artifacts."""
        return True

    def save(
        self,
        *,
        path: str | os.PathLike[str],
        format: ArtifactFormat = "binary",
        signing_key: Any = None,
    ) -> None:
        """Write the artifact atomically. ``signing_key`` (an Ed25519 private key: a PEM
        file path, PEM bytes or a ``cryptography`` key) signs it, so that loads with
        ``trusted_keys`` accept it."""
        _check_format(format)
        target = os.fspath(path)
        try:
            if format == "binary":
                write_binary(target, self._manifest, self._payloads, signing_key)
            else:
                write_unpacked(target, self._manifest, self._payloads, signing_key)
        except PrecompileError:
            raise
        except OSError as exc:  # nothing was written in its place (atomic writes)
            raise CacheWriteError(
                exc.errno or 0,
                f"could not save the artifact to {target!r} ({exc.strerror or exc})",
            ) from exc
        # what saves killed part way left beside it (their targets were left whole)
        for left in remove_abandoned_temps(os.path.dirname(os.path.abspath(target))):
            log.info("removed %s, left by a save that did not finish", left)
        log.info("saved %s artifact to %s%s", format, target, " (signed)" if signing_key else "")

    @staticmethod
    def load(
        path: str | os.PathLike[str] | None = None,
        *,
        format: ArtifactFormat = "binary",
        warmup: bool | Literal["background"] = False,
        trusted_keys: TrustedKeysOption = None,
        run_edited_code: bool = False,
        tag: str | None = None,
        key: str | None = None,
        cache: Any = None,
        cudagraphs: CudaGraphsOption = None,
        output_structure: OutputStructure = "upstream",
    ) -> CompiledArtifact:
        """Read and verify an artifact; variants load on first use unless ``warmup``.

        From a file or directory (``path``), or from an ArtifactCache by ``tag`` or
        ``key`` (``cache``: default the process's default cache; its own trusted keys
        apply). ``trusted_keys`` (public keys: hex, PEM files or PEM bytes; default
        ``$PRECOMPILE_TRUSTED_KEYS``): when set, the artifact must be signed by one of
        them, checked before anything in it is unpickled or imported.
        ``run_edited_code``: run an edited ``output_code.py`` of an unpacked artifact
        (otherwise an edit is ignored, with a warning). ``cudagraphs``: replay CUDA
        graphs per size (see ``CudaGraphs``); None keeps the artifact's stored default.
        ``output_structure``: ``"upstream"`` returns what upstream's loaded artifacts
        return, a flat list of outputs even for a graph that returns one value (a
        ``split_module`` piece); ``"graph"`` returns the graph's own structure, as the
        compiling process does."""
        _check_format(format)
        if output_structure not in _OUTPUT_STRUCTURES:
            raise InvalidOptionError(
                f"output_structure must be 'upstream' or 'graph', got {output_structure!r}"
            )
        if warmup not in (True, False, "background"):
            raise InvalidOptionError(f"warmup must be True, False or 'background', got {warmup!r}")
        if (path is None) == (tag is None and key is None) or (tag is not None and key is not None):
            raise InvalidOptionError("load takes exactly one of path=, tag= or key=")
        if path is None:
            if trusted_keys is not None or run_edited_code:
                raise InvalidOptionError(
                    "loading by tag or key uses the cache's own trusted keys: pass "
                    "trusted_keys to ArtifactCache(...), not to load()"
                )
            artifact = CompiledArtifact._from_cache(cache, tag, key)
        else:
            artifact = CompiledArtifact._from_path(
                os.fspath(path), format, resolve_trusted_keys(trusted_keys), run_edited_code
            )
        if output_structure == "upstream":
            artifact._unflatten = _output_unflattener(artifact.manifest, flat=True)
        if cudagraphs is not None:
            artifact.set_cudagraphs(cudagraphs)
        if warmup:
            artifact.warmup(background=warmup == "background")
        return artifact

    @staticmethod
    def _from_cache(cache: Any, tag: str | None, key: str | None) -> CompiledArtifact:
        store = cache_to_read(cache)
        if tag is not None:
            key = store.tagged(tag)
            if key is None:
                raise ArtifactNotFoundError(f"no entry is tagged {tag!r} in {store.root}", key=tag)
        assert key is not None
        entry = store.get(key, lazy=True)  # payloads read as variants load
        if entry is None:
            raise ArtifactNotFoundError(
                f"cache {store.root} has no intact entry {key[:12]}"
                + (f" (tagged {tag!r})" if tag else ""),
                key=key,
            )
        return artifact_from_entry(entry)

    @staticmethod
    def _from_path(
        source: str, format: str, trusted: tuple[bytes, ...] | None, run_edited_code: bool
    ) -> CompiledArtifact:
        if format == "binary" and run_edited_code:
            raise InvalidOptionError("run_edited_code applies to format='unpacked' only")
        try:
            if format == "binary":
                manifest, payloads, _ = read_binary(source, trusted)
            else:
                manifest, payloads, _ = read_unpacked(
                    source, trusted, run_edited_code=run_edited_code
                )
        except CorruptArtifactError as exc:
            if exc.path is None:  # the readers' checks see bytes; the file is known here
                exc.path = source
            raise
        except FileNotFoundError as exc:  # one of ours (a FileNotFoundError still)
            if isinstance(exc, ArtifactNotFoundError):
                raise
            raise ArtifactNotFoundError(f"no artifact at {source!r}: {exc.strerror}") from None
        check_compatible(manifest.environment, f"artifact {source!r}")
        return CompiledArtifact(manifest, payloads)


def artifact_from_entry(entry: StoredEntry) -> CompiledArtifact:
    """The artifact a cache entry holds (its document a manifest, its blobs the payloads),
    checked for every payload and for this build and device."""
    where = f"cache entry {entry.key[:12]}"
    manifest = Manifest.from_json(entry.document)
    missing = [d for d in manifest.payload_digests if d not in entry.blobs]
    if missing:
        raise CorruptArtifactError(f"{where} lacks payload {missing[0][:12]}")
    check_compatible(manifest.environment, where)
    # read (and verified by the cache) when a variant loads: see ArtifactCache.get(lazy=)
    blobs = entry.blobs
    artifact = CompiledArtifact(manifest, LazyPayloads(blobs.__getitem__, holds=blobs.__contains__))
    artifact.cache_key = entry.key
    return artifact


def _with_index_checks(
    function: Callable[..., Any], checks: tuple[tuple[int, int], ...], names: Sequence[str]
) -> Callable[..., Any]:
    """``function`` refusing calls whose index inputs leave their tables (``_contract``),
    and raising a compiled kernel's failed index check as ``IndexOutOfRangeError``."""

    def checked(*args: Any) -> Any:
        try:
            check_indices(args, checks)
        except IndexOutOfRangeError as exc:
            index = label_index(exc.input_name, ())
            raise exc.restated(
                name_inputs(str(exc), names),
                input_name=None if index is None else input_label(index, names),
            ) from None
        try:
            return function(*args)
        except RuntimeError as exc:
            failed = kernel_index_failure(str(exc))
            if failed is None:
                raise
            raise IndexOutOfRangeError(failed) from None

    checked.__dict__.update(getattr(function, "__dict__", {}))  # what it says of itself (lean)
    return checked
