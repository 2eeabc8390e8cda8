"""specplug's engine patches, declared once: what each replaces, wraps or registers, what
it expects to find there, on which engine versions, and whether it is applied.

A `Patch` names its target by dotted path ("module.attr", "module.Class.attr"), the
replacement (a function given the original, so a wrapper is natural; or "module:name",
resolved when applied), the original it expects (`Expect`: qualname, module, leading
parameters, type), the engine versions it was written for, and its kind:
- REPLACE: the attribute becomes replacement(original) (a class, a module global);
- WRAP: the same, where the new value wraps the original method or function;
- REGISTERED: replacement(original) registers through the engine's own API (SGLang's
  HookRegistry, SpeculativeAlgorithm.register, vLLM's register_backend) and returns a
  token for `unregister`; recorded here so the list of patches is complete;
- INSTANCE: per-object attributes set at run time (`PatchSet.on`), recorded as patches
  of the class attribute they shadow (or, with `Expect.instance_of`, of the class whose
  instances they replace).
A `PatchSet` holds one engine's patches and their state in this process: `check` (does
the target match, patching nothing), `apply` (once per process; a target that does not
match is refused with a WARNING naming what was expected and found, never patched),
`undo`, `report` (for `specplug doctor`) and `markdown` (docs/architecture.md's table:
`python -m specplug.patch_list --markdown`).

Standard library only, and engine-free: engine modules are imported by name when a
patch is checked or applied.
"""

from __future__ import annotations

import inspect
import logging
import pkgutil
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

REPLACE, WRAP, REGISTERED, INSTANCE = "replace", "wrap", "registered", "instance"
KINDS = (REPLACE, WRAP, REGISTERED, INSTANCE)
ACTIVE = "active"  # applied by the adapter's register() when it activates
STAY_OUT = "stay out"  # applied by register() only when specplug stays out
MARK = "__specplug_patch__"  # set on every value a patch installs: its patch's name
# The adapters' patch declarations (engine-free modules), for the CLI below
BEGIN, END = "<!-- patches:begin (generated: python -m specplug.patch_list --markdown) -->", "<!-- patches:end -->"


class PatchRefused(RuntimeError):
    """An instance patch that cannot be applied to this object (or in this process)."""


def resolve(ref):
    """A "module:name" / dotted reference resolved (imports the module); anything else as is."""
    return pkgutil.resolve_name(ref) if isinstance(ref, str) else ref


def value(ref) -> Callable:
    """A replacement that ignores the original: `ref` (resolved when applied)."""
    def replacement(original, *args):
        return resolve(ref)

    return replacement


@dataclass(frozen=True)
class Expect:
    """What the engine's own original is; an original that differs is not patched.

    qualname: its __qualname__ ("GPUModelRunner._prepare_inputs"; kept by functools.wraps).
    module: the module it is defined in (or a package above it: "vllm").
    params: its leading parameter names, in order (self / cls included).
    instance_of: dotted name of a class the original is an instance of.
    check: any other test: original -> None, or why it does not match; `says` describes it.
    """

    qualname: str | None = None
    module: str | None = None
    params: tuple[str, ...] = ()
    instance_of: str | None = None
    check: Callable[[Any], str | None] | None = None
    says: str = ""

    def mismatch(self, original) -> str | None:
        """None when `original` is what is expected, else what differs."""
        obj = original.__func__ if inspect.ismethod(original) else original
        if self.instance_of is not None:
            cls = resolve(self.instance_of)
            if not isinstance(original, cls):
                return f"found a {_name(type(original))}, expected a {self.instance_of}"
        found = getattr(obj, "__qualname__", None)
        if self.qualname is not None and found != self.qualname:
            return f"found {_name(obj)}, expected {self.qualname}"
        module = getattr(obj, "__module__", None) or ""
        if self.module is not None and not (module == self.module or module.startswith(self.module + ".")):
            return f"found {_name(obj)} (defined in {module or '?'}), expected one defined in {self.module}"
        if self.params:
            try:
                names = tuple(inspect.signature(obj).parameters)
            except (TypeError, ValueError):
                return f"found {_name(obj)} without a readable signature, expected ({', '.join(self.params)}, ...)"
            if names[:len(self.params)] != self.params:
                return f"found {_name(obj)}({', '.join(names)}), expected ({', '.join(self.params)}, ...)"
        return self.check(original) if self.check is not None else None

    def describe(self) -> str:
        """One line for the docs table."""
        parts = []
        if self.instance_of:
            parts.append(f"a {self.instance_of}")
        if self.qualname or self.module:
            where = f"{self.module}." if self.module and self.qualname else (self.module or "")
            parts.append(f"{where}{self.qualname or ''}"
                         + (f"({', '.join(self.params)}, ...)" if self.params else ""))
        elif self.params:
            parts.append(f"parameters ({', '.join(self.params)}, ...)")
        if self.says:
            parts.append(self.says)
        return "; ".join(parts) or "-"


@dataclass(frozen=True)
class Patch:
    """One engine patch, declared once (see the module docstring for the kinds).

    name: unique in its PatchSet. target: dotted "module.attr" / "module.Class.attr".
    replacement: original (+ apply's arguments) -> new value; REGISTERED: registers and
      returns a token; INSTANCE: called per object by PatchSet.on. A "module:name" string
      is resolved when applied.
    does: one line, what it changes (docs and doctor). files: specplug modules involved.
    group: when it is applied (ACTIVE, STAY_OUT, or a command such as "specplug serve").
    versions: the engine versions it was written for (a "+local" suffix ignored); None: any.
    when: the condition in words ("vLLM-CPU only"); skip: () -> None, or why it does not
      apply here (a function or "module:name").
    via: REGISTERED: the dotted name of the engine API it registers through.
    unregister: REGISTERED: token -> None (undo); None where the engine cannot unregister.
    """

    name: str
    target: str
    kind: str
    replacement: Callable | str
    expect: Expect
    does: str
    files: str
    group: str = ACTIVE
    versions: tuple[str, ...] | None = None
    when: str = ""
    skip: Callable[[], str | None] | str | None = None
    via: str | None = None
    unregister: Callable[[Any], None] | str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"patch {self.name}: kind {self.kind!r} is not one of {KINDS}")
        if "." not in self.target:
            raise ValueError(f"patch {self.name}: target {self.target!r} must be a dotted 'module.attr'")
        if self.kind == REGISTERED and not self.via:
            raise ValueError(f"patch {self.name}: a REGISTERED patch names the engine API it uses (via=)")

    @property
    def owner(self) -> str:
        return self.target.rsplit(".", 1)[0]

    @property
    def attr(self) -> str:
        return self.target.rsplit(".", 1)[1]

    @property
    def shadows_class_attribute(self) -> bool:
        """INSTANCE patches without `instance_of` shadow an attribute of the class itself."""
        return self.expect.instance_of is None

    @property
    def sites(self) -> tuple[str, ...]:
        """The dotted engine names the patch needs (each resolves on a matching engine)."""
        own = self.target if self.kind != INSTANCE or self.shadows_class_attribute else self.owner
        extra = (self.expect.instance_of,) if self.expect.instance_of else ()
        return tuple(dict.fromkeys((own, *extra, *([self.via] if self.via else []))))


@dataclass
class PatchState:
    """A patch in this process. matched: the target is what it expects (None: not checked,
    or it does not apply here); applied: installed; reason: why not."""

    matched: bool | None = None
    applied: bool = False
    reason: str | None = None
    # how to undo it
    owner: Any = None
    raw: Any = None  # the owner's own attribute before (vars(owner)[attr])
    had_own: bool = False
    value: Any = None  # what was installed, or the registration token
    instances: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


class PatchSet:
    """One engine's patches, in the order they are applied, with their state in this process."""

    def __init__(self, engine: str, version: Callable[[], str], patches: Iterable[Patch]):
        self.engine = engine
        self._version = version
        self._patches = {}
        for patch in patches:
            if patch.name in self._patches:
                raise ValueError(f"two {engine} patches are named {patch.name!r}: names must be unique")
            self._patches[patch.name] = patch
        self._state = {name: PatchState() for name in self._patches}

    def __iter__(self) -> Iterator[Patch]:
        return iter(self._patches.values())

    def __len__(self) -> int:
        return len(self._patches)

    def __getitem__(self, name: str) -> Patch:
        try:
            return self._patches[name]
        except KeyError:
            raise KeyError(f"no {self.engine} patch named {name!r}; there are {list(self._patches)}") from None

    def state(self, name: str) -> PatchState:
        self[name]  # KeyError naming the patches
        return self._state[name]

    def group(self, group: str) -> list[Patch]:
        return [p for p in self if p.group == group]

    def sites(self) -> tuple[str, ...]:
        """Every engine name the patches need, in order, once each."""
        return tuple(dict.fromkeys(site for p in self for site in p.sites))

    # -- checking ----------------------------------------------------------------------------
    def check(self, name: str) -> PatchState:
        """Whether the patch would apply here (a fresh PatchState; nothing patched): the
        version guard, its condition, the target found and the original as expected."""
        patch, state = self[name], self._state[name]
        if state.applied:
            return PatchState(matched=True, applied=True)
        why = self._refusal(patch)
        if why is None:
            return PatchState(matched=True)
        matched, reason = why
        return PatchState(matched=matched, reason=reason)

    def _refusal(self, patch: Patch) -> tuple[bool | None, str] | None:
        """None when the patch can be applied, else (matched, why not); matched is None
        when the patch does not apply here (its condition), False when refused."""
        if patch.versions is not None:
            try:
                installed = self._version()
            except Exception as exc:  # an engine that is not installed or fails to import
                return False, f"{self.engine} version unknown ({_short(exc)})"
            if installed.split("+")[0] not in patch.versions:
                return False, (f"written for {self.engine} {', '.join(patch.versions)}, this is {installed}")
        if patch.skip is not None:
            why = resolve(patch.skip)()
            if why is not None:
                return None, why
        try:
            owner = pkgutil.resolve_name(patch.owner)
        except Exception as exc:  # ImportError, AttributeError, or whatever an engine module raises
            return False, f"{patch.owner} not found ({_short(exc)})"
        if patch.kind == INSTANCE and not patch.shadows_class_attribute:
            if not isinstance(owner, type):
                return False, f"{patch.owner} is not a class"
            try:
                resolve(patch.expect.instance_of)
            except Exception as exc:
                return False, f"{patch.expect.instance_of} not found ({_short(exc)})"
            return None
        if not hasattr(owner, patch.attr):
            return False, f"{patch.owner} has no attribute {patch.attr!r}"
        current = getattr(owner, patch.attr)
        if _mark(current) == patch.name:
            return None  # installed by this patch already (e.g. by an earlier copy of this module)
        mismatch = patch.expect.mismatch(current)
        return None if mismatch is None else (False, mismatch)

    # -- applying ----------------------------------------------------------------------------
    def apply(self, group: str = ACTIVE, *, log: bool = True) -> list[PatchState]:
        """Apply every patch of `group` not applied yet, in order; one INFO line names them
        (log=False: none), one WARNING per refused patch. Returns their states."""
        states = [self.apply_one(p.name, log=log) for p in self.group(group)]
        if log:
            done = [f"{p.name} ({p.kind})" for p, s in zip(self.group(group), states) if s.applied]
            logger.info("specplug patched %s (%s): %s", self.engine, group, ", ".join(done) or "nothing")
        return states

    def apply_one(self, name: str, *args, log: bool = True) -> PatchState:
        """Apply one patch once per process (args go to its replacement); a refused patch is
        recorded with why (and logged as a WARNING when log), never raised (an error of the
        replacement itself is)."""
        patch, state = self[name], self._state[name]
        if state.applied:
            return state
        refusal = self._refusal(patch)
        if refusal is not None:
            state.matched, state.reason = refusal
            if log and state.matched is False:
                logger.warning("specplug did not patch %s (%s): %s", patch.target, patch.name, state.reason)
            elif log:
                logger.debug("specplug patch %s does not apply here: %s", patch.name, state.reason)
            return state
        owner = pkgutil.resolve_name(patch.owner)
        state.owner, state.matched, state.reason = owner, True, None
        if patch.kind == INSTANCE:
            state.applied = True  # objects are patched by on()
            return state
        original = getattr(owner, patch.attr)
        if _mark(original) == patch.name:  # already there (an earlier copy of this module)
            state.applied, state.value = True, original
            state.raw, state.had_own = getattr(original, "__wrapped__", original), True
            return state
        new = resolve(patch.replacement)(original, *args)
        if patch.kind == REGISTERED:
            state.value = new
        else:
            _set_mark(new, patch.name)
            state.had_own = patch.attr in _own_vars(owner)
            state.raw = _own_vars(owner).get(patch.attr)
            setattr(owner, patch.attr, new)
            state.value = new
        state.applied = True
        logger.debug("specplug patch %s applied to %s", patch.name, patch.target)
        return state

    def on(self, name: str, obj, *args):
        """Apply INSTANCE patch `name` to one object: obj.<attr> = replacement(its current
        value, *args); returns the new value. PatchRefused when the patch is not applied in
        this process, `obj` is not an instance of the class, or its value is not the expected one."""
        patch, state = self[name], self._state[name]
        if patch.kind != INSTANCE:
            raise TypeError(f"patch {name} is a {patch.kind} patch; on() applies INSTANCE patches")
        reason = self.instance_refusal(name, obj)
        if reason is not None:
            raise PatchRefused(reason)
        original = getattr(obj, patch.attr)
        if obj not in state.instances:
            state.instances[obj] = (patch.attr in _own_vars(obj), _own_vars(obj).get(patch.attr))
        new = resolve(patch.replacement)(original, *args)
        _set_mark(new, patch.name)
        setattr(obj, patch.attr, new)
        return new

    def instance_refusal(self, name: str, obj) -> str | None:
        """None when INSTANCE patch `name` can be applied to `obj`, else why not (patches nothing)."""
        patch, state = self[name], self._state[name]
        if not state.applied:
            why = state.reason or f"{self.engine}'s patches were not applied in this process"
            return f"specplug patch {name} ({patch.target}) is not applied: {why}"
        if not isinstance(obj, state.owner):
            return f"specplug patch {name}: {_name(type(obj))} is not a {patch.owner}"
        if not hasattr(obj, patch.attr):
            return f"specplug patch {name}: this {_name(type(obj))} has no attribute {patch.attr!r}"
        current = getattr(obj, patch.attr)
        if _mark(current) == patch.name:
            return None  # patched before: the original it wraps was checked then
        mismatch = patch.expect.mismatch(current)
        return None if mismatch is None else f"specplug did not patch {patch.target} of this object: {mismatch}"

    # -- undoing -----------------------------------------------------------------------------
    def undo(self, name: str) -> None:
        """Put back what patch `name` replaced (every object it patched, for INSTANCE);
        RuntimeError for a REGISTERED patch whose engine API cannot unregister."""
        patch, state = self[name], self._state[name]
        if not state.applied:
            self._state[name] = PatchState()
            return
        if patch.kind == REGISTERED:
            if patch.unregister is None:
                raise RuntimeError(f"specplug patch {name} cannot be undone: {patch.via} has no way to unregister")
            resolve(patch.unregister)(state.value)
        elif patch.kind == INSTANCE:
            for obj, (had_own, raw) in list(state.instances.items()):
                _put_back(obj, patch.attr, had_own, raw)
        else:
            _put_back(state.owner, patch.attr, state.had_own, state.raw)
        self._state[name] = PatchState()

    def undo_all(self) -> None:
        """Undo every applied patch, the last applied first."""
        for patch in reversed(list(self)):
            self.undo(patch.name)

    # -- reporting ---------------------------------------------------------------------------
    def report(self, check: bool = True) -> list[dict]:
        """One dict per patch (what `specplug doctor --json` shows): name, target, kind,
        group, versions, when, matched, applied, reason. Checks each target (imports the
        engine modules named; check=False: matched None), patches nothing."""
        rows = []
        for patch in self:
            try:
                state = self.check(patch.name) if check else PatchState(applied=self._state[patch.name].applied)
            except Exception as exc:  # a bad setting or a broken module: say so, keep going
                state = PatchState(matched=False, reason=f"could not check: {_short(exc)}")
            rows.append({"name": patch.name, "target": patch.target, "kind": patch.kind, "group": patch.group,
                         "versions": list(patch.versions) if patch.versions is not None else None,
                         "when": patch.when or None, "matched": state.matched, "applied": state.applied,
                         "reason": state.reason})
        return rows

    def markdown(self) -> str:
        """The patches as a markdown table (docs/architecture.md)."""
        lines = ["| patch | kind | target | expected original | applied | what it does | files |",
                 "|---|---|---|---|---|---|---|"]
        for p in self:
            kind = f"{p.kind} (`{'.'.join(p.via.split('.')[-2:])}`)" if p.kind == REGISTERED else p.kind
            versions = f"{self.engine} {', '.join(p.versions)}" if p.versions is not None else "any version"
            applied = "; ".join(x for x in (p.group, versions, p.when) if x)
            lines.append("| " + " | ".join(_cell(x) for x in (
                p.name, kind, f"`{p.target}`", p.expect.describe(), applied, p.does, p.files)) + " |")
        return "\n".join(lines)


def markdown(patch_sets: Iterable[PatchSet]) -> str:
    """Every engine's table under its own heading: the block between BEGIN and END."""
    return "\n\n".join(f"#### {s.engine}\n\n{s.markdown()}" for s in patch_sets)


def docs_block(text: str) -> str | None:
    """The generated block of a document (between BEGIN and END), None without one."""
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def with_block(text: str, block: str) -> str:
    """`text` with its generated block replaced by `block` (ValueError without the markers)."""
    if docs_block(text) is None:
        raise ValueError(f"the document has no generated block: add the lines {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{rest.split(END, 1)[1]}"


def _name(obj) -> str:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _own_vars(obj) -> dict:
    try:
        return vars(obj)
    except TypeError:
        return {}


def _mark(obj):
    return _own_vars(obj).get(MARK)


def _set_mark(obj, name: str) -> None:
    try:
        setattr(obj, MARK, name)
    except (AttributeError, TypeError):  # values that take no attributes are recognised by state only
        pass


def _put_back(owner, attr: str, had_own: bool, raw) -> None:
    if had_own:
        setattr(owner, attr, raw)
    elif attr in _own_vars(owner):
        delattr(owner, attr)
