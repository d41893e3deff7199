"""The decode forms' decisions as one table, read by the PyTorch forms and the JAX backend.

Torch-free (it imports nothing), so ``replayssm.jax`` reads the same decisions without the
PyTorch forms.  Two tables:

* :data:`KINDS`: what a step kind decides for every form (and for the layer around the
  form: the conv, the shared ring / paged pointers), one :class:`Kind` per kind;
* :data:`STEPS`: per form (``recurrent``, ``replay``, ``kv``) and step kind, one
  :class:`Step`: the op family entry that computes the step's outputs
  (``ops_for(family).<op>``; the JAX backend maps the same names to its own functions),
  what the step does to each store of the form (checkpoint / recurrent ``state``, input
  ``ring``, paged KV-only ``pages``), what it keeps for the commit and what the commit runs.

The ``mixed`` form (KV-only rows and replay rows in one step) is no row: it runs the ``kv``
and ``replay`` rows of the same kind, each on its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

__all__ = ["Kind", "KINDS", "STEP_KINDS", "FORMS", "Store", "Step", "STEPS", "step", "form_stores", "ring_flush"]


# ------------------------------------------------------------------------------ step kinds
@dataclass(frozen=True)
class Kind:
    """What one step kind decides, whatever the form."""

    name: str
    cached: bool      # False: no cache at all (``full``: a plain forward)
    padded: bool      # right-padded (packed) rows of their own lengths: padding leaves no trace;
    #                   a fresh row reads no past (the JAX backend's prefill takes fresh rows only)
    tentative: bool   # entries pending until a commit (verify, tree); else the step commits itself
    tree: bool        # the tentative entries form a tree: the commit keeps a root-to-leaf path
    conv: str         # conv op entry of the step (``ops_for("conv").<conv>``)
    conv_commit: str  # conv op entry of the commit ("" when the step commits itself)

    @property
    def keeps_window(self) -> bool:
        """The step writes the conv window itself (else: no cache, or the commit does)."""
        return self.cached and not self.tentative


#: every step kind; ``full`` is the no-cache forward (no form runs it: the layer's plain scan)
KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("full", cached=False, padded=False, tentative=False, tree=False,
         conv="conv_prefill", conv_commit=""),
    Kind("prefill", cached=True, padded=True, tentative=False, tree=False,
         conv="conv_prefill_varlen", conv_commit=""),
    Kind("decode", cached=True, padded=False, tentative=False, tree=False,
         conv="conv_decode", conv_commit=""),
    Kind("verify", cached=True, padded=False, tentative=True, tree=False,
         conv="conv_verify", conv_commit="conv_commit"),
    Kind("tree", cached=True, padded=False, tentative=True, tree=True,
         conv="conv_tree", conv_commit="conv_commit_tree"),
)}

#: step kinds a form runs (``StepContext.kind`` of a cached call)
STEP_KINDS: tuple[str, ...] = tuple(k for k, v in KINDS.items() if v.cached)



def ring_flush(hist, kind: str, T: int, L: int):
    """Rows of a ring form that write their checkpoint in a step of ``kind`` (the rule of
    ``replayssm.cache.ring``; ``hist``: committed entries per row, an array of any framework,
    ``T`` new entries, ring capacity ``L``): a step committing itself flushes when the ring
    fills (``h + 1 >= L``), a tentative one a window early (``h + 2T > L``: its entries stay
    clear of the committed ones until the commit)."""
    return (hist + 2 * T > L) if KINDS[kind].tentative else (hist + 1 >= L)


# ------------------------------------------------------------------------------ form x kind
@dataclass(frozen=True)
class Store:
    """What a step does to one store of the form (parsed from a cell of :data:`_TABLE`)."""

    read: bool = False       # r: read (prefill: unless the row is fresh)
    write: bool = False      # w: state rewritten on every row / a: entries appended (ring, pages)
    flush: bool = False      # F / f: the flushing rows write the checkpoint ...
    with_new: bool = False   # F: ... S_{h+1} (the step's entry included); f: S_h (committed only)
    at_commit: bool = False  # c: written by the commit (from what the step keeps)
    reset: bool = False      # 0: emptied (prefill: the final state becomes the checkpoint)

    @property
    def used(self) -> bool:
        return self.read or self.write or self.flush or self.at_commit or self.reset

    @classmethod
    def parse(cls, cell: str) -> "Store":
        bad = set(cell) - set("rwaFfc0-")
        if bad or ("-" in cell and cell != "-"):
            raise ValueError(f"bad store cell {cell!r}")
        return cls(read="r" in cell, write="w" in cell or "a" in cell, flush="F" in cell or "f" in cell,
                   with_new="F" in cell, at_commit="c" in cell, reset="0" in cell)


@dataclass(frozen=True)
class Step:
    """One form's decisions for one step kind."""

    form: str
    kind: str
    op: str          # op family entry computing the outputs (``ops_for(family).<op>``)
    state: Store     # the checkpoint (replay) / the recurrent state (recurrent)
    ring: Store      # the ring of the last ``h`` inputs (replay)
    pages: Store     # the paged entries since the sequence start (KV-only)
    pending: str     # what the step keeps for the commit (pending key; "" for none)
    commit: str      # what the commit runs (a form's commit entry; "" when only pointers move)

    @property
    def info(self) -> Kind:
        return KINDS[self.kind]


# Legend: state / ring / pages cells -- r read, w written on every row, a entries appended,
# F / f flushing rows write S_{h+1} / S_h, c written by the commit, 0 emptied, - unused.
# ``full`` (no cache) is the same plain chunked scan in every form.
_TABLE = """
form       kind     op                      state  ring  pages  pending  commit
recurrent  full     chunked_prefill         -      -     -      -        -
recurrent  prefill  chunked_prefill_varlen  rw     -     -      -        -
recurrent  decode   recurrent_update        rw     -     -      -        -
recurrent  verify   snapshot_verify         rc     -     -      snap     snapshot_commit
recurrent  tree     recurrent_step          rc     -     -      nodes    snapshot_commit
replay     full     chunked_prefill         -      -     -      -        -
replay     prefill  chunked_prefill_varlen  rw     r0    -      -        -
replay     decode   replay_decode           rF     ra    -      -        -
replay     verify   replay_verify           rf     ra    -      -        -
replay     tree     tree_verify             rf     ra    -      -        gather_path
kv         full     chunked_prefill         -      -     -      -        -
kv         prefill  kv_verify               -      -     ra     -        -
kv         decode   kv_verify               -      -     ra     -        -
kv         verify   kv_verify               -      -     ra     -        -
kv         tree     kv_tree_verify          -      -     ra     -        gather_path
"""


def _parse(text: str) -> dict[tuple[str, str], Step]:
    lines = [ln.split() for ln in text.strip().splitlines()]
    head, rows = lines[0], lines[1:]
    out: dict[tuple[str, str], Step] = {}
    for row in rows:
        if len(row) != len(head):
            raise ValueError(f"bad table row {row}")
        d = dict(zip(head, row))
        if d["kind"] not in KINDS:
            raise ValueError(f"unknown step kind {d['kind']!r} in the forms' table")
        s = Step(form=d["form"], kind=d["kind"], op=d["op"], state=Store.parse(d["state"]),
                 ring=Store.parse(d["ring"]), pages=Store.parse(d["pages"]),
                 pending="" if d["pending"] == "-" else d["pending"],
                 commit="" if d["commit"] == "-" else d["commit"])
        out[(s.form, s.kind)] = s
    return out


#: ``(form, kind) -> Step`` for every form and step kind
STEPS: dict[tuple[str, str], Step] = _parse(_TABLE)

#: forms with a row per step kind (the registered forms add ``mixed``, a composition)
FORMS: tuple[str, ...] = tuple(dict.fromkeys(f for f, _ in STEPS))

for _f in FORMS:
    _missing = [k for k in KINDS if (_f, k) not in STEPS]
    if _missing:
        raise ValueError(f"form {_f!r} has no row for step kinds {_missing}")


def step(form: str, kind: str) -> Step:
    """The decisions of ``form`` for a step of ``kind``."""
    try:
        return STEPS[(form, kind)]
    except KeyError:
        raise ValueError(f"no step ({form!r}, {kind!r}) in the forms' table: forms {FORMS}, "
                         f"kinds {tuple(KINDS)}") from None


@cache
def form_stores(form: str) -> frozenset[str]:
    """Stores some step of ``form`` uses: ``state``, ``ring``, ``pages``."""
    return frozenset(name for (f, _), s in STEPS.items() if f == form
                     for name in ("state", "ring", "pages") if getattr(s, name).used)
