"""Memory Plan for the whole workflow: text encoder(s), one or two diffusion models (Wan 2.2's
high- and low-noise experts) and the VAE, planned together over one machine's VRAM, RAM and disk.

Plain Python; knows nothing of ComfyUI. Each component gets the single-model candidates of
:mod:`memorykit.memory_plan` (as loaded, fp8 resident, stream from RAM, fp8 + stream from RAM,
stream from disk; under dynamic VRAM core's residency), predicted for VRAM alone. The components
run one after the other (encode, sample with each expert, decode), so:

- VRAM: each component needs its own peak while it runs; core moves the others out (to RAM) when
  they do not fit beside it (``comfy.model_management.load_models_gpu`` frees memory first).
- RAM: components live in RAM while others run. The peak is the largest, over components j, of
  what j holds while it runs plus what every other component holds at rest (a resident one's
  weights back in RAM; a streamed one's RAM copies; a disk one's ring and the blocks that were
  resident). Nothing is evicted when every component's resident bytes fit VRAM together.
- disk: the disk-streamed components' files add up.
- seconds per prompt: ``TEXTS_PER_PROMPT`` encodes by each text encoder, ``STEPS_PER_PROMPT``
  steps shared by the diffusion models, and, for an evicted component, its resident bytes loaded
  again over the bus once per prompt.

Every combination of candidates is predicted; the fastest that fits is picked (prefer=memory:
the least VRAM within ``MEMORY_SLOWDOWN`` of the fastest). Nothing fits: :class:`PlanError`
naming the component and the shortfall.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from .memory_plan import (
    MEMORY_SLOWDOWN,
    Candidate,
    Machine,
    ModelFigures,
    PlanError,
    PlanOptions,
    candidates,
    gib_text,
)

# ComfyUI's templates encode a positive and a negative prompt and sample 20 steps (the estimate's
# unit: one prompt; a text encoder runs once per text, the diffusion models once per step).
TEXTS_PER_PROMPT = 2
STEPS_PER_PROMPT = 20
ROLES = ("text encoder", "diffusion model", "VAE")
_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class Component:
    """One part of the workflow. ``role``: ``text encoder`` / ``diffusion model`` / ``VAE``;
    ``name``: what the sentences call it ("text encoder", "diffusion model 2 (low noise)");
    ``figures``: its bytes and work (for a text encoder ``flops_per_step`` and
    ``activation_bytes`` are those of one encode); ``share``: its share of the prompt's steps
    (two experts: 0.5 each). A VAE is counted for its weights only (its tiles are planned apart)."""

    role: str
    name: str
    figures: ModelFigures
    share: float = 1.0

    @property
    def runs_per_prompt(self) -> float:
        if self.role == "text encoder":
            return TEXTS_PER_PROMPT
        if self.role == "diffusion model":
            return STEPS_PER_PROMPT * self.share
        return 1.0


@dataclass
class Decision:
    """A component's pick in the chosen combination, with its RAM at rest and the sentence."""

    component: Component
    pick: Candidate
    ram_rest_bytes: int
    evicted: bool
    seconds_per_prompt: float
    sentence: str = ""

    def as_dict(self) -> dict:
        c = self.pick
        return {"component": self.component.name, "role": self.component.role, "label": self.component.figures.label,
                "weight_bytes": self.component.figures.weight_bytes, "pick": c.name, "fp8": c.fp8,
                "offload_to": c.offload_to, "peak_vram_bytes": c.peak_vram_bytes, "ram_run_bytes": c.peak_ram_bytes,
                "ram_rest_bytes": self.ram_rest_bytes, "disk_bytes": c.disk_bytes,
                "streamed_bytes": c.streamed_bytes, "est_s": c.est_s, "seconds_per_prompt": self.seconds_per_prompt,
                "evicted": self.evicted, "sentence": self.sentence}


@dataclass
class WorkflowPlan:
    machine: Machine
    options: PlanOptions
    decisions: list[Decision]
    peak_vram_bytes: int
    peak_ram_bytes: int
    disk_bytes: int
    seconds_per_prompt: float
    combinations: int
    fitting: int
    reasons: list[str] = field(default_factory=list)

    def decision(self, name: str) -> Decision:
        return next(d for d in self.decisions if d.component.name == name)

    def as_dict(self) -> dict:
        return {"decisions": [d.as_dict() for d in self.decisions], "peak_vram_bytes": self.peak_vram_bytes,
                "peak_ram_bytes": self.peak_ram_bytes, "disk_bytes": self.disk_bytes,
                "seconds_per_prompt": self.seconds_per_prompt, "combinations": self.combinations,
                "fitting": self.fitting, "reasons": list(self.reasons)}


def vae_candidate(figures: ModelFigures, m: Machine) -> Candidate:
    """The VAE as core runs it: loaded to the GPU to decode, in RAM otherwise (its tiles are
    planned by :func:`memorykit.memory_plan.choose_tile`)."""
    w = figures.weight_bytes
    return Candidate("as loaded", False, None, "resident", peak_vram_bytes=w if m.gpu else 0,
                     peak_ram_bytes=0 if m.gpu else w, resident_bytes=w if m.gpu else 0)


# Stream from disk is also offered at smaller VRAM budgets, in these steps (see _disk_ladder).
DISK_BUDGET_STEP = 2 << 30


def _disk_ladder(m: Machine, f: ModelFigures, opts: PlanOptions) -> list[Candidate]:
    """Stream from disk at budgets 0, 2, 4 … GiB below the single-model pick's (which keeps all
    that fits resident): in a workflow core moves a component out of VRAM while another runs,
    and the blocks a disk plan kept resident come back into RAM, so a smaller budget can be what
    lets the workflow fit. Activations batched (cond + uncond) or, when those do not fit, one
    after the other (two forwards per step), as :func:`memorykit.memory_plan.candidates`."""
    from .memory_plan import _check, _streamed
    if not f.block_bytes or not m.gpu or m.dynamic_vram:
        return []
    out, seen = [], set()
    for act, forwards in ((f.activations, 1), (f.activation_min_bytes, 2)):
        if act is None:
            continue
        top = m.usable_vram - int(act)
        for budget in range(0, max(0, top), DISK_BUDGET_STEP):
            lean = replace(m, vram_bytes=m.reserve_vram_bytes + int(act) + budget)
            c = _check(_streamed("stream from disk", False, "disk", "memorykit", f.block_bytes, f.other_bytes, lean, f,
                                 int(act), replace(opts, prefer="speed"), f.weight_bytes, f.weight_bytes, forwards),
                       m, m.usable_vram)
            if c.fits and (c.resident_bytes, forwards) not in seen:
                seen.add((c.resident_bytes, forwards))
                out.append(c)
        if out:
            break
    return out


def _ram_rest(c: Candidate, evicted: bool) -> int:
    """RAM a component holds while another runs: what it holds running, plus (when core moves it
    out of VRAM) the bytes that were resident on the GPU and are not already counted in RAM
    (as loaded and disk plans hold no RAM copy of them; fp8 and RAM-streamed plans do)."""
    back = c.resident_bytes if evicted and (c.name == "as loaded" or c.offload_to == "disk") else 0
    return c.peak_ram_bytes + back


def _evaluate(comps, picks, m: Machine):
    together = sum(c.resident_bytes for c in picks) + max((c.peak_vram_bytes - c.resident_bytes for c in picks), default=0)
    evicted = m.gpu and len(picks) > 1 and together > m.usable_vram
    rest = [_ram_rest(c, evicted) for c in picks]
    ram = max(c.peak_ram_bytes + sum(rest) - r for c, r in zip(picks, rest))
    disk = sum(c.disk_bytes for c in picks)
    secs = [comp.runs_per_prompt * c.est_s + (c.resident_bytes / m.h2d_bytes_per_s if evicted else 0.0)
            for comp, c in zip(comps, picks)]
    vram = max(c.peak_vram_bytes for c in picks)
    short = []
    if ram > m.ram_bytes:
        short.append(("RAM", ram - m.ram_bytes))
    if disk > m.disk_bytes:
        short.append(("disk", disk - m.disk_bytes))
    return {"picks": picks, "rest": rest, "evicted": evicted, "ram": ram, "disk": disk, "secs": secs,
            "total": sum(secs), "vram": vram, "short": short}


def plan_workflow(machine: Machine, components: list[Component], options: PlanOptions | None = None) -> WorkflowPlan:
    """One plan for every component (see the module docstring). Raises ValueError for a bad
    option or no component, :class:`PlanError` naming the component and what is short."""
    options = options or PlanOptions()
    options.validate()
    if not components:
        raise ValueError("Memory Plan: nothing to plan (connect a model)")
    relaxed = replace(machine, ram_bytes=_UNLIMITED, disk_bytes=_UNLIMITED)
    per = []
    for comp in components:
        if comp.role == "VAE":
            per.append([vae_candidate(comp.figures, machine)])
            continue
        cands = candidates(relaxed, comp.figures, options) + _disk_ladder(relaxed, comp.figures, options)
        fits = [c for c in cands if c.fits]
        if not fits:
            best = min(cands, key=lambda c: c.peak_vram_bytes)
            raise PlanError(f"Memory Plan: {comp.name} ({comp.figures.label}, {gib_text(comp.figures.weight_bytes)}) does "
                            f"not fit {gib_text(machine.vram_bytes)} of VRAM in any way: the least it needs, {best.name}, is "
                            f"{gib_text(best.peak_vram_bytes)} against {gib_text(machine.usable_vram)} usable "
                            f"(VRAM short by {gib_text(best.peak_vram_bytes - machine.usable_vram)}). Lower the latent "
                            "size or use a smaller model file.")
        per.append(fits)
    combos = [_evaluate(components, list(p), machine) for p in itertools.product(*per)]
    ok = [c for c in combos if not c["short"]]
    if not ok:
        raise PlanError(_shortfall(machine, components, combos))
    fastest = min(ok, key=lambda c: (c["total"], c["vram"]))
    if options.prefer == "speed":
        best = fastest
    else:
        near = [c for c in ok if c["total"] <= MEMORY_SLOWDOWN * fastest["total"]]
        best = min(near, key=lambda c: (c["vram"] if machine.gpu else c["ram"], c["total"]))
    decisions = [Decision(comp, c, r, best["evicted"], s)
                 for comp, c, r, s in zip(components, best["picks"], best["rest"], best["secs"])]
    plan = WorkflowPlan(machine, options, decisions, best["vram"], best["ram"], best["disk"], best["total"],
                        len(combos), len(ok))
    for d in decisions:
        d.sentence = _sentence(d, plan, per[components.index(d.component)])
    plan.reasons = _summary(plan) + [d.sentence for d in decisions]
    return plan


def _shortfall(m: Machine, comps: list[Component], combos: list[dict]) -> str:
    """The PlanError text: the combination closest to fitting, each component's share of the
    RAM/disk that is short, the largest named as the one to shrink."""
    c = min(combos, key=lambda c: sum(s for _, s in c["short"]))
    what, by = max(c["short"], key=lambda s: s[1])
    held = [(r if what == "RAM" else p.disk_bytes, comp) for comp, p, r in zip(comps, c["picks"], c["rest"])]
    big = max(held, key=lambda h: h[0])[1]
    parts = ", ".join(f"{comp.name} {p.name} {gib_text(r if what == 'RAM' else p.disk_bytes)}"
                      for comp, p, r in zip(comps, c["picks"], c["rest"]))
    return (f"Memory Plan: the workflow does not fit this machine ({gib_text(m.vram_bytes)} VRAM, {gib_text(m.ram_bytes)} RAM, "
            f"{gib_text(m.disk_bytes)} disk): {what} short by {gib_text(by)} even in the closest plan ({parts}; "
            f"{what} {gib_text(c['ram'] if what == 'RAM' else c['disk'])} needed). The largest is the {big.name} "
            f"({big.figures.label}, {gib_text(big.figures.weight_bytes)}): load a smaller file of it (fp8, GGUF), or add "
            f"{what}{' (free disk in the offload folder)' if what == 'disk' else ''}.")


def _summary(plan: WorkflowPlan) -> list[str]:
    m = plan.machine
    out = []
    if m.dynamic_vram and m.gpu:
        out.append("ComfyUI's dynamic VRAM manages the models: core decides which weights stay in VRAM and streams the "
                   "rest; the plan chooses fp8 storage, disk versus RAM and tiles.")
    out.append(f"Whole workflow: peak VRAM {gib_text(plan.peak_vram_bytes)} of {gib_text(m.usable_vram)} usable (the "
               f"components run one after the other"
               + (", core moves each out of VRAM while another runs" if plan.decisions[0].evicted else
                  ", all resident together") +
               f"), peak RAM {gib_text(plan.peak_ram_bytes)} of {gib_text(m.ram_bytes)}, disk {gib_text(plan.disk_bytes)} of "
               f"{gib_text(m.disk_bytes)}; about {plan.seconds_per_prompt:.1f} s per prompt ({TEXTS_PER_PROMPT} texts, "
               f"{STEPS_PER_PROMPT} steps); {plan.fitting} of {plan.combinations} combinations fit.")
    return out


def _sentence(d: Decision, plan: WorkflowPlan, fits: list[Candidate]) -> str:
    """"text encoder (Flux2TEModel_, 42.66 GiB): stream from disk, 42.66 GiB read once per text,
    ~16.3 s; why: ..." — the decision and one reason, with the figures."""
    comp, c, m = d.component, d.pick, plan.machine
    f = comp.figures
    head = f"{comp.name} ({f.label}, {gib_text(f.weight_bytes)} {f.dtype}): {c.name}"
    if comp.role == "VAE":
        return head + f", {gib_text(d.ram_rest_bytes)} in RAM while the others run (its tiles are planned below)."
    src = "disk" if c.offload_to == "disk" else "RAM"
    if comp.role == "text encoder":
        what = (f", {gib_text(c.streamed_bytes)} read from {src} once per text, ~{c.est_s:.1f} s" if c.streamed_bytes
                else f", ~{c.est_s:.2f} s per text")
    else:
        what = (f", {gib_text(c.streamed_bytes)} per step from {src}, ~{c.est_s:.2f} s/step" if c.streamed_bytes
                else f", ~{c.est_s:.2f} s/step")
    if c.residency == "core dynamic VRAM":
        why = "core's dynamic VRAM places its weights"
    elif c.offload_to == "disk":
        why = (f"RAM ({gib_text(m.ram_bytes)}) cannot also hold its {gib_text(f.weight_bytes)} next to the other "
               f"components ({gib_text(plan.peak_ram_bytes - d.ram_rest_bytes)} at the peak)")
    elif c.offload_to == "cpu":
        w = f.fp8_bytes if c.fp8 else f.weight_bytes
        why = (f"its {gib_text(w)} of weights and {gib_text(c.peak_vram_bytes - c.vram_budget_bytes)} of working memory "
               f"exceed {gib_text(m.usable_vram)} usable VRAM: {gib_text(c.resident_bytes)} stays, the rest streams")
    elif c.fp8:
        why = f"fp8 ({gib_text(f.fp8_bytes)}) fits VRAM where {gib_text(f.weight_bytes)} does not, and beats streaming"
    else:
        why = f"it fits {gib_text(m.usable_vram)} usable VRAM ({gib_text(c.peak_vram_bytes)} with its working memory)"
    if c.fp8 and c.offload_to is not None:
        why += "; fp8 halves what crosses the bus"
    if d.evicted and c.offload_to != "disk" and comp.role != "VAE":
        why += f"; core moves it to RAM while the others run ({gib_text(d.ram_rest_bytes)} held)"
    return f"{head}{what}; why: {why}."


# Text encoders: the planning estimate encodes this many tokens (Flux 2 and Wan pad or cap near 512).
ENCODE_TOKENS = 512


def encoder_figures(module, label: str, dtype: str, tokens: int = ENCODE_TOKENS, fp8: bool = True) -> ModelFigures:
    """:class:`ModelFigures` of a text encoder module (meta tensors work: only sizes are read).
    Bytes are the bytes stored (a quantized weight's stored parts: fp8_scaled, GGUF).
    Blocks: the children of its largest ``ModuleList`` (the transformer layers); fp8 (unless
    ``fp8`` is False): the torch Linear layers inside those blocks whose weight is a plain
    high-precision tensor (embeddings, norms, the final projection and layers a file already
    stores quantized keep their dtype; none left: fp8 not offered);
    working memory of one encode: ``tokens`` × the summed output widths of one block's Linear
    layers × the element size, plus one attention score matrix (tokens² × heads, heads =
    width / 128); FLOPs: 2 × parameters × ``tokens``."""
    import torch

    from .memory_plan import module_figures
    lists = [(n, m) for n, m in module.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())
    name, blocks = max(lists, key=lambda x: size(x[1])) if lists else ("", [])
    block_lists = [(name, [(f"{name}.{i}", b) for i, b in enumerate(blocks)])] if lists else []
    cast = {f"{name}.{i}.{n}" for i, b in enumerate(blocks) for n, x in b.named_modules()
            if fp8 and isinstance(x, torch.nn.Linear) and type(x.weight.data) is torch.Tensor
            and x.weight.dtype in (torch.float16, torch.bfloat16, torch.float32)}
    first = blocks[0] if lists else module
    lin = [x for x in first.modules() if hasattr(x, "in_features") and hasattr(x, "out_features")]  # core's quantized too
    elem = {torch.float32: 4}.get(getattr(lin[0].weight, "dtype", None), 2) if lin else 2
    width = max((x.in_features for x in lin), default=0)
    act = tokens * sum(x.out_features for x in lin) * elem + tokens * tokens * max(1, width // 128) * elem
    params = sum(p.numel() for p in module.parameters())
    return module_figures(module, block_lists, cast or None, label, dtype, int(act), 2.0 * params * tokens)
