"""Stage `runtime` (GPU): the launcher of a symbolic Triton kernel (Note: symbolic blocks,
codegen/blocks.py), which sorts its calls into size classes and keeps a launch configuration
per class.

It takes what the renderer says about the kernel (its `BlockPlan.launch` facts: the Python source
of its x extent and of its row length over the size variables, the size cap of 32-bit index
math, the longest row its persistent variant may take) and gives `SizedTritonLauncher`, which the
wrapper calls as it calls a static kernel's `TritonLauncher` (runtime/triton.py).

Note: size classes
    One symbolic kernel serves every shape, but its best launch configuration depends on the
    sizes of the call: XBLOCK and warps on the x extent (a few rows want small blocks and many
    programs, millions of elements large ones), the variant on the row (a row that fits one block
    runs persistent, a longer one looped: a symbolic row's kernel has both variants). So each call
    is sorted into a *size class*: (the power of two at or above its x extent, that of its row
    length, whether it is past the size cap), computed by one generated function of the size
    arguments (`size_classifier`) that also gives the grid's x extent. Each class gets its own
    configuration at its first call, chosen as a static kernel's is at its first call (Note:
    bounded tuning, runtime/triton.py) at the class's largest sizes, so a class of sizes a static
    kernel would be compiled for gets the configuration that static kernel would get:
    - under the interpreter or with autotune off: the first candidate (tests see persistent for
      short rows and looped for long ones);
    - a tiny class (at most TINY_KERNEL_ELEMENTS elements, launch-bound): the kernel's default,
      the first candidate at its largest sizes, which the compile pool compiled when the wrapper
      loaded, so a small shape compiles nothing; where that default cannot serve the class (a
      persistent block shorter than its rows), the class's first candidate;
    - else the winner recorded for this class (beside the module, keyed by the class), or the
      fastest of its candidates, timed and recorded. Candidates not compiled yet go to the
      compile pool together before the timing (the candidates at the largest sizes were
      compiled at load; most classes' candidates are among them: only a symbolic row's
      persistent blocks and short looped blocks are new).
    What the fast path reads per class (`SizeClassLaunch`) is made under the launcher's lock and
    published into `classes` once complete. A call costs the classifier's call and one dict
    lookup more than a static kernel's (benchmarks/triton_launch_overhead.py measures it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ember.metrics import metrics
from ember.runtime.triton import (
    TINY_KERNEL_ELEMENTS,
    LaunchConfig,
    TritonLauncher,
    argument_types,
    candidates,
)

# (x extent bits, row length bits, past the size cap): a call's size class
SizeClass = tuple[int, int, bool]
REMEMBERED_SIZES = 1024  # the most distinct sizes a launcher keeps the grid and class of


@dataclass
class SizeClassLaunch:
    """What the fast path of one size class reads; its direct launches are added under the
    launcher's lock (Note: the fast launch, runtime/triton.py)."""

    config: LaunchConfig
    constexprs: tuple[int, ...]
    wide: bool  # 64-bit index math (Note: symbolic blocks)
    compiled: dict[tuple[bool, ...], tuple] = field(default_factory=dict)  # pointer alignments -> direct launch
    direct_aligned: tuple | None = None  # the direct launch for 16-byte aligned pointers


def size_classifier(variables: list[str], x_source: str, xextent_source: str, rnumel: int | str,
                    size_cap: int) -> Callable[..., tuple[int, SizeClass]]:  # fmt: skip
    """One function of the size arguments giving (the x extent, the size class) of a call (Note:
    size classes). Sources are Python over the variables (uop/variables.py `python_source`,
    ember's own text); a static row's bits are a constant."""
    extent = f"({xextent_source})" if xextent_source else "x"
    row = f"(({rnumel}) - 1).bit_length()" if isinstance(rnumel, str) else str(max(0, rnumel - 1).bit_length())
    wide = " or ".join(f"{v} > {size_cap}" for v in variables) if size_cap else "False"
    source = (f"def classify({', '.join(variables)}):\n    x = {x_source}\n"
              f"    return x, (({extent} - 1).bit_length(), {row}, {wide})\n")  # fmt: skip
    namespace: dict[str, Any] = {"max": max, "min": min}
    exec(compile(source, "<ember size classes>", "exec"), namespace)  # noqa: S102
    return namespace["classify"]


class SizedTritonLauncher(TritonLauncher):
    """A symbolic kernel as the wrapper calls it (Note: size classes). Its size arguments are at
    positions `variables_at` on; a call past `size_cap` takes the kernel's 64-bit-index twin."""

    def __init__(self, module: Any, name: str, variants: list[str], xnumel: int, rnumel: int, written: list[int],
                 interpret: bool, variables: list[str], variables_at: int, grid_numel: str = "",
                 xextent_source: str = "", rnumel_source: str = "", persistent_row: int = 0, size_cap: int = 0,
                 **launch: Any) -> None:  # fmt: skip
        super().__init__(module, name, variants, xnumel, rnumel, written, interpret, **launch)
        assert self.signature is not None, "runtime: a symbolic Triton kernel needs its argument types"
        self.size_arguments = range(variables_at, variables_at + len(variables))
        self.first, self.stop = variables_at, variables_at + len(variables)
        self.size_cap, self.persistent_row = size_cap, persistent_row
        self.symbolic_row = bool(rnumel_source)
        row: int | str = rnumel_source or rnumel or 1
        self.classify = size_classifier(variables, grid_numel or str(xnumel), xextent_source, row, size_cap)
        # the buffers come first, then the sizes, then the error flags
        self.leading_pointers = all(i in self.pointers for i in range(variables_at))
        self.trailing_pointers = tuple(i for i in self.pointers if i >= self.size_arguments.stop)
        self.classes: dict[SizeClass, SizeClassLaunch] = {}
        self.by_sizes: dict[tuple, tuple[int, SizeClassLaunch]] = {}  # a call's sizes -> (grid, its class)

    def __call__(self, *args: Any) -> None:
        found = self.by_sizes.get(args[self.first : self.stop])
        if found is None:
            found = self.remember(args)
        grid, sized = found
        if self.interpret:
            self.launch(sized.config, args)
            return
        combined = 0  # Note: the fast launch (runtime/triton.py)
        if self.leading_pointers:  # (the common case: no seed among the buffers)
            for a in args[: self.first]:
                combined |= a.data_ptr()
            for i in self.trailing_pointers:
                combined |= args[i].data_ptr()
        else:
            for i in self.pointers:
                combined |= args[i].data_ptr()
        direct = sized.direct_aligned if not combined & 15 else None
        if direct is None:
            direct = self.class_direct_for(sized, args)
        launch, function, head = direct
        launch(grid, 1, 1, self.current_stream(self.stream_device), function, *head, *args, *sized.constexprs)

    def remember(self, args: tuple) -> tuple[int, SizeClassLaunch]:
        """The grid and size class of a call's sizes, kept for the next call with the same sizes
        (a pure function of them, so threads writing one entry write the same value)."""
        sizes = args[self.first : self.stop]
        x, key = self.classify(*sizes)
        sized = self.classes.get(key) or self.configure_class(key, args)
        found = ((x + sized.config.xblock - 1) // sized.config.xblock, sized)
        if len(self.by_sizes) >= REMEMBERED_SIZES:
            self.by_sizes.clear()  # (a generate loop meets a new length at every step)
        self.by_sizes[sizes] = found
        return found

    def class_direct_for(self, sized: SizeClassLaunch, args: tuple) -> tuple:
        """The direct launch of the class's kernel for these pointer alignments, compiled at its
        first need under the lock."""
        aligned = tuple(i not in self.pointers or args[i].data_ptr() % 16 == 0 for i in range(len(args)))
        direct = sized.compiled.get(aligned)
        if direct is None:
            with self.lock:
                direct = sized.compiled.get(aligned)
                if direct is None:
                    direct = sized.compiled[aligned] = self.compile_direct(sized.config, args, aligned, sized.wide)
                    if all(aligned):
                        sized.direct_aligned = direct  # last: the fast path reads it without the lock
        return direct

    # ---- the configuration of a size class (Note: size classes) ------------------------------

    def configure_class(self, key: SizeClass, args: tuple) -> SizeClassLaunch:
        with self.lock:
            sized = self.classes.get(key)
            if sized is None:
                config = self.choose_for_class(key, args)
                blocks = self.grid_and_blocks(config)[1]
                sized = SizeClassLaunch(config, tuple(blocks.values()), key[2])
                metrics.add(triton_size_classes=1)
                metrics.tally("triton_size_class_variants", {config.variant: 1})
                self.classes[key] = sized  # last: the fast path reads it without the lock
        return sized

    def class_sizes(self, key: SizeClass) -> tuple[int, int]:
        """The largest x extent and row of a class (0: a pointwise kernel's row)."""
        return 1 << key[0], (1 << key[1]) if self.rnumel else 0

    def variants_for(self, rnumel: int) -> list[str]:
        """The variants that can run rows of `rnumel`: a symbolic row's persistent block only up
        to the longest row it may take."""
        if self.symbolic_row and rnumel > self.persistent_row:
            return [v for v in self.variants if v != "persistent"]
        return self.variants

    def class_candidates(self, key: SizeClass) -> list[LaunchConfig]:
        x, r = self.class_sizes(key)
        return candidates(self.variants_for(r), x, r, self.interpret)[: self.tuned]

    def default_config(self) -> LaunchConfig:
        """The first candidate at the kernel's largest sizes (compiled when the wrapper loads)."""
        return candidates(self.variants_for(self.rnumel), self.xextent, self.rnumel, self.interpret)[0]

    def choose_for_class(self, key: SizeClass, args: tuple) -> LaunchConfig:
        options = self.class_candidates(key)
        if self.interpret or not self.autotune:
            return options[0]
        x, r = self.class_sizes(key)
        if x * max(1, r) <= TINY_KERNEL_ELEMENTS:  # launch-bound: the default, compiled at load
            default = self.default_config()
            if default.variant != "persistent" or default.rblock >= r:
                return default
            options = options[:1]
        target, device_name = self.device_of(args)
        if len(options) > 1:
            winner = self.recorded_winner(device_name, key)
            options = [winner] if winner in options else options
        self.compile_ahead(options, args, target, key[2])
        return options[0] if len(options) == 1 else self.timed_winner(options, args, target, device_name, key)

    def compile_ahead(self, options: list[LaunchConfig], args: tuple, target: tuple[str, int, int],
                      wide: bool) -> None:  # fmt: skip
        """Hands a new class's configurations to the compile pool at once, so they compile in
        parallel (those compiled at load are found there) before a launch needs them."""
        if self.pool is None:
            return
        aligned = tuple(i not in self.pointers or args[i].data_ptr() % 16 == 0 for i in range(len(args)))
        for config in options:
            self.pool.submit(self.request(config, argument_types(args, self.signature), aligned, target, wide))

    # ---- what the base launcher asks per call ------------------------------------------------

    def grid_of(self, config: LaunchConfig, args: tuple) -> int:
        x, _ = self.classify(*args[self.first : self.stop])
        return (x + config.xblock - 1) // config.xblock

    def wide_for(self, args: tuple) -> bool:
        return self.classify(*args[self.first : self.stop])[1][2]

    def interpreted(self, args: tuple) -> tuple:
        from ember.runtime.triton_libdevice import interpreted_size

        return tuple(interpreted_size(a) if i in self.size_arguments else a for i, a in enumerate(args))

    def tuning_plan(self, device_name: str) -> list[LaunchConfig]:
        """The configurations compiled when the wrapper loads: the candidates at the kernel's
        largest sizes (the default first), which most size classes' candidates are among."""
        options = candidates(self.variants_for(self.rnumel), self.xextent, self.rnumel, self.interpret)
        return options[:1] if self.interpret or not self.autotune else options[: self.tuned]


def launcher_type(launch: dict) -> type[TritonLauncher]:
    """The launcher class for a kernel's launch facts: sized where it takes size variables."""
    return SizedTritonLauncher if launch.get("variables") else TritonLauncher
