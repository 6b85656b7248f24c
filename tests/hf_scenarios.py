"""Rank side of tests/test_hf.py: an HF LlamaForCausalLM (from a config, no download) trained,
saved, exported, loaded back with ``zerofx.checkpoint.load_hf`` and asked to ``generate``."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tests.multirank import attempt

VOCAB = 96
PROMPT = torch.tensor([[3, 17, 42, 5, 9], [1, 2, 3, 4, 5]])
NEW_TOKENS = 4


def tiny_llama(seed: int = 0, hidden: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class _ContrastiveLoss(torch.nn.Module):
    def __init__(self, clip):
        super().__init__()
        self.clip = clip

    def forward(self, input_ids, pixel_values):
        return self.clip(input_ids=input_ids, pixel_values=pixel_values, return_loss=True).loss


def tiny_clip():
    """``zerofx.testing.verify``'s factory for an HF ``CLIPModel`` from a config: two towers of
    width 32 and its temperature, ``logit_scale``, a 0-dim parameter; the model returns CLIP's
    contrastive loss over the batch."""
    from transformers import CLIPConfig, CLIPModel

    towers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    config = CLIPConfig(
        text_config=dict(towers, vocab_size=VOCAB, max_position_embeddings=16),
        vision_config=dict(towers, image_size=16, patch_size=8, num_channels=3),
        projection_dim=16,
    )

    def batch(n: int, gen: torch.Generator):
        return torch.randint(0, VOCAB, (n, 8), generator=gen), torch.randn(n, 3, 16, 16, generator=gen)

    return _ContrastiveLoss(CLIPModel(config)), batch


class _LanguageModelLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


def tiny_mixtral():
    """``zerofx.testing.verify``'s factory for an HF ``MixtralForCausalLM`` from a config: two
    layers of width 32, 2 experts (each token to both), whose weights transformers stacks as
    ``gate_up_proj`` [2, 96, 32] and ``down_proj`` [2, 32, 48]: fewer rows than 4 ranks."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )

    def batch(n: int, gen: torch.Generator):
        return (torch.randint(0, VOCAB, (n, 12), generator=gen),)

    return _LanguageModelLoss(MixtralForCausalLM(config)), batch


def _token_batch(n: int, gen: torch.Generator):
    return (torch.randint(0, VOCAB, (n, 12), generator=gen),)


# ``zerofx.testing.verify``'s factories for HF architectures whose parameters differ in kind from
# Llama's, each from a small config, dropout off (the replica and the compiled graph would draw
# other masks): the layer, weight tying and attention each brings
def _language_model(config_class: str, model_class: str, **config):
    """transformers' ``model_class(config_class(vocab_size=VOCAB, **config))`` as a loss, with
    ``_token_batch``."""
    import transformers

    model = getattr(transformers, model_class)(getattr(transformers, config_class)(vocab_size=VOCAB, **config))
    return _LanguageModelLoss(model), _token_batch


def tiny_gpt2():
    """GPT-2: Conv1D layers (weights stored [in, out]: the gathered rows are input features), a
    tied embedding and LM head, learned positions."""
    sizes = dict(n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    return _language_model("GPT2Config", "GPT2LMHeadModel", **sizes, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)


def tiny_t5():
    """T5: an encoder and a decoder sharing one embedding, tied to the LM head, relative
    position biases in the first layer of each, the decoder fed the shifted labels."""
    sizes = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    return _language_model("T5Config", "T5ForConditionalGeneration", **sizes, dropout_rate=0, decoder_start_token_id=0)


_SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32
)


def tiny_bert():
    """BERT's masked-LM head: a decoder tied to the word embeddings with a bias of its own,
    token-type and position embeddings, post-norm layers."""
    no_dropout = dict(hidden_dropout_prob=0, attention_probs_dropout_prob=0)
    return _language_model("BertConfig", "BertForMaskedLM", **_SMALL, **no_dropout)


def tiny_deepseek_v3():
    """DeepSeek-V3: multi-head latent attention (low-rank query and key-value projections with
    their norms), a dense first layer, then a shared expert beside 4 routed ones (top 2 of them
    per token) with a routing bias."""
    experts = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)
    latent = dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8)
    return _language_model(
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        **_SMALL,
        moe_intermediate_size=32,
        num_key_value_heads=4,
        **experts,
        **latent,
    )


def _checkpointed(factory, **enable):
    """``factory()``'s model with transformers' activation checkpointing on (``enable``: its
    ``every_n_layers``, ``offload``, ``activation_checkpointing_kwargs``), in training mode."""
    model, batch = factory()
    model.model.activation_checkpointing_enable(**enable)
    model.train()
    return model, batch


def tiny_llama_checkpointed():
    """A tiny LlamaForCausalLM with transformers' activation checkpointing on both layers."""
    return _checkpointed(lambda: (_LanguageModelLoss(tiny_llama()), _token_batch))


def tiny_t5_checkpointed():
    """T5 with transformers' activation checkpointing: its attention layers also make their
    zero position bias a leaf that requires grad while checkpointing is on, which the eager
    model then rounds otherwise."""
    return _checkpointed(tiny_t5)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _full_state(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def train_and_save(rank: int, world: int, folder: str) -> None:
    """Stage 3: two AdamW steps on rank-dependent tokens, then a checkpoint; rank 0 also writes
    the trained whole parameters, which the export must reproduce exactly."""
    import zerofx

    model = zerofx.compile(tiny_llama(), _mesh(world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    zerofx.checkpoint.save(f"{folder}/ckpt", model, opt)
    state = _full_state(model)
    if rank == 0:
        torch.save(state, f"{folder}/trained.pt")


def _generate(model, **kwargs) -> torch.Tensor:
    return model.generate(
        PROMPT,
        attention_mask=torch.ones_like(PROMPT),
        pad_token_id=0,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        **kwargs,
    )


def load_and_generate(rank: int, world: int, folder: str, stages: list[int]) -> dict:
    """Per stage: a differently initialized model, compiled, loaded from the exported HF folder;
    its parameters must be the trained ones bit for bit, and generate() must give the
    reference's tokens with and without ``zerofx.gathered``."""
    import zerofx

    trained = torch.load(f"{folder}/trained.pt")
    reference = tiny_llama(seed=7).eval()
    reference.load_state_dict(trained)
    with torch.no_grad():
        want_tokens = _generate(reference)
        want_logits = reference(input_ids=PROMPT).logits
    results: dict = {}

    def one(stage: int) -> dict:
        model = zerofx.compile(tiny_llama(seed=stage).eval(), _mesh(world), stage=stage)
        zerofx.checkpoint.load_hf(f"{folder}/hf", model)
        loaded = _full_state(model)
        out = {"params_equal": sorted(k for k in trained if torch.equal(loaded[k], trained[k]))}
        with torch.no_grad():
            out["per_step_tokens"] = _generate(model).tolist()
            with zerofx.gathered(model) as g:
                out["gathered_nbytes"] = g.nbytes
                out["gathered_tokens"] = _generate(model).tolist()
                out["gathered_logits_equal"] = torch.equal(model(input_ids=PROMPT).logits, want_logits)
        try:  # gradients cannot flow through the gathered copies: an error, not a silent no-op
            with zerofx.gathered(model):
                model(input_ids=PROMPT)
            out["grad_error"] = None
        except zerofx.ZeroFXError as e:
            out["grad_error"] = str(e)
        out["expected_nbytes"] = sum(
            s.param.numel() * s.param.element_size() for s in zerofx.sharding.runtime_of(model).states if not s.whole
        )
        return out

    for stage in stages:
        attempt(results, f"stage{stage}", lambda: one(stage))
    results["want_tokens"] = want_tokens.tolist()
    results["keys"] = sorted(trained)
    return results


# -- the HF Trainer ---------------------------------------------------------------------------------

TRAINER_STEPS = 3
TRAINER_ACCUMULATION = 2
TRAINER_PER_RANK = 2


class TokenDataset(torch.utils.data.Dataset):
    """Fixed random token sequences (learnable by memorizing), as a Trainer dataset."""

    def __init__(self, n: int = 48, seq: int = 12):
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_args(out: str, per_device: int, **extra):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=out,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=TRAINER_ACCUMULATION,
        max_steps=TRAINER_STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **extra})


def trainer_history(trainer) -> list[dict]:
    return [{"loss": h["loss"], "grad_norm": h["grad_norm"]} for h in trainer.state.log_history if "loss" in h]


def unsharded_trainer(out: str, world: int, optim: str = "adamw_torch", checkpointing: bool = False) -> dict:
    """The reference: one process, the whole global batch per device (world x per-rank).
    ``checkpointing``: ``TrainingArguments(activation_checkpointing=True)``."""
    from transformers import Trainer

    trainer = Trainer(
        model=tiny_llama(),
        args=trainer_args(out, TRAINER_PER_RANK * world, optim=optim, activation_checkpointing=checkpointing),
        train_dataset=TokenDataset(),
    )
    trainer.train()
    return {
        "history": trainer_history(trainer),
        "params": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
    }


def zerofx_trainer(out: str, stage: int, optim: str = "adamw_torch", checkpointing: bool = False) -> dict:
    """One rank of a torchrun-launched job (zerofx.launch.local_ranks): ZeroFXTrainer, then
    save_model; returns the logged history (the parent compares it with the unsharded run), and
    with ``checkpointing`` what became of the Trainer's activation checkpointing."""
    from zerofx.hf import ZeroFXTrainer
    from zerofx.runtime.params import runtime_of

    args = trainer_args(
        f"{out}/run", TRAINER_PER_RANK, ddp_backend="gloo", optim=optim, activation_checkpointing=checkpointing
    )
    model = tiny_llama()
    trainer = ZeroFXTrainer(model=model, args=args, train_dataset=TokenDataset(), zerofx_options={"stage": stage})
    trainer.train()
    trainer.save_model(f"{out}/saved")
    return {
        "history": trainer_history(trainer),
        "checkpoint_report": runtime_of(model).checkpoint_report,
        "checkpoint_modules": runtime_of(model).compiled.options.checkpoint_modules,
        "layers_flagged": sorted(n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False)),
        "args_kept": args.activation_checkpointing,
    }


def tiny_lora_llama(seed: int = 0):
    """``tiny_llama`` with PEFT LoRA adapters on the attention's q and v projections (the base
    frozen; the adapters' B matrices drawn too, so that step 1's gradients reach both)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    model = get_peft_model(base, config)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def unsharded_lora_trainer(out: str, world: int) -> dict:
    """The reference for ``zerofx_lora_trainer``: the plain Trainer in one process, the global batch."""
    from transformers import Trainer

    trainer = Trainer(
        model=tiny_lora_llama(), args=trainer_args(out, TRAINER_PER_RANK * world), train_dataset=TokenDataset()
    )
    trainer.train()
    trainer.save_model(f"{out}/saved")
    return {"history": trainer_history(trainer)}


def zerofx_lora_trainer(out: str) -> dict:
    """One torchrun-launched rank: ZeroFXTrainer on a PEFT LoRA model, save_model (the adapters,
    as the plain Trainer writes them), then a fresh model (other adapter values) loading that
    folder as a checkpoint, compared with the trained adapters."""
    from zerofx.hf import ZeroFXTrainer

    def adapters(model) -> dict[str, torch.Tensor]:
        return {
            k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for k, p in model.named_parameters()
            if p.requires_grad
        }

    args = trainer_args(f"{out}/run", TRAINER_PER_RANK, ddp_backend="gloo")
    trainer = ZeroFXTrainer(model=tiny_lora_llama(), args=args, train_dataset=TokenDataset())
    trainer.train()
    trainer.save_model(f"{out}/saved")
    trained = adapters(trainer.model)
    fresh = ZeroFXTrainer(model=tiny_lora_llama(seed=7), args=args, train_dataset=TokenDataset())
    before = adapters(fresh.model)
    fresh._load_from_checkpoint(f"{out}/saved")  # the Trainer's hook for resume / load_best_model_at_end
    loaded = adapters(fresh.model)
    return {
        "history": trainer_history(trainer),
        "moved_by_load": max((loaded[k] - before[k]).abs().max().item() for k in trained),
        "loaded_vs_trained": max((loaded[k] - trained[k]).abs().max().item() for k in trained),
    }


RESUME_STEPS = 4  # saving every 2 steps: checkpoint-2 is resumed from, checkpoint-4 is the end


def _resumable_trainer(out: str, eval_dataset=None, **extra):
    from zerofx.hf import ZeroFXTrainer

    args = trainer_args(
        out,
        TRAINER_PER_RANK,
        ddp_backend="gloo",
        save_strategy="steps",
        save_steps=2,
        max_steps=RESUME_STEPS,
        lr_scheduler_type="linear",  # a scheduler with state worth restoring
        **extra,
    )
    return ZeroFXTrainer(model=tiny_llama(), args=args, train_dataset=TokenDataset(), eval_dataset=eval_dataset)


def _record_checkpoint_io() -> list[tuple]:
    """Every zerofx.checkpoint.save / load from now on, as (what, where, with optimizer, whole
    model) rows: what the Trainer writes and reads, and how often."""
    import zerofx.checkpoint as ck

    calls: list[tuple] = []
    save, load = ck.save, ck.load

    def counted_save(path, model, optimizer=None, **kw):
        calls.append(("save", Path(path).parent.name, optimizer is not None, True))
        return save(path, model, optimizer, **kw)

    def counted_load(path, model, optimizer=None, **kw):
        calls.append(("load", Path(path).parent.name, optimizer is not None, kw.get("load_model", True)))
        return load(path, model, optimizer, **kw)

    ck.save, ck.load = counted_save, counted_load
    return calls


def trainer_checkpoints(out: str) -> dict:
    """One rank of a torchrun-launched job: 4 steps saving a resumable checkpoint every 2 steps;
    returns the logged history, the final whole parameters, what checkpoint-2 holds and every
    zerofx.checkpoint call of the run."""
    trainer = _resumable_trainer(f"{out}/run")
    io = _record_checkpoint_io()
    trainer.train()
    io = list(io)
    params = _full_state(trainer.model)
    # load_best_model_at_end, "best" being the highest evaluation loss: checkpoint-2's
    best = _resumable_trainer(
        f"{out}/best",
        eval_dataset=TokenDataset(n=10),
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=3,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )
    best.train()
    return {
        "history": trainer_history(trainer),
        "params": params,
        "files": sorted(p.name for p in Path(f"{out}/run/checkpoint-2").iterdir()),
        "best_checkpoint": Path(best.state.best_model_checkpoint).name,
        "evals": [h["eval_loss"] for h in best.state.log_history if "eval_loss" in h],
        "final_eval": best.evaluate()["eval_loss"],
        "io": io,
    }


def trainer_resumed(out: str) -> dict:
    """One rank of a fresh torchrun-launched job: a new model and Trainer resumed from the first
    run's checkpoint-2 (model, optimizer, scheduler, RNG), trained to step 4; then another resumed
    from a copy of checkpoint-2 without its zerofx_state (a model-only checkpoint: its
    safetensors, and a fresh optimizer)."""
    import shutil

    import torch.distributed as dist

    trainer = _resumable_trainer(f"{out}/resumed")
    io = _record_checkpoint_io()
    trainer.train(resume_from_checkpoint=f"{out}/run/checkpoint-2")
    io = [row for row in io if row[0] == "load"]
    params = _full_state(trainer.model)
    model_only = Path(f"{out}/model-only/checkpoint-2")
    if dist.get_rank() == 0:
        shutil.copytree(f"{out}/run/checkpoint-2", model_only, ignore=shutil.ignore_patterns("zerofx_state"))
    dist.barrier()
    fresh = _resumable_trainer(f"{out}/model-only")
    fresh.train(resume_from_checkpoint=str(model_only))
    return {"history": trainer_history(trainer), "params": params, "model_only": trainer_history(fresh), "io": io}


def meta_load_and_generate(rank: int, world: int, folder: str, stages: list[int]) -> dict:
    """Per stage: the model built on the meta device, sharded (each rank allocates its rows
    only), refused a forward before loading, then loaded with ``load_hf`` (its rotary buffers
    recomputed by HF's own init); the allocator's peak over build + shard + load, against the
    whole model's bytes."""
    import zerofx
    from zerofx.measure.allocations import AllocationTrace

    trained = torch.load(f"{folder}/trained.pt")
    whole_bytes = sum(t.numel() * t.element_size() for t in trained.values())
    reference = tiny_llama(seed=7).eval()
    reference.load_state_dict(trained)
    with torch.no_grad():
        want_tokens = _generate(reference).tolist()
    results: dict = {"whole_bytes": whole_bytes, "want_tokens": want_tokens}

    def one(stage: int) -> dict:
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        mesh = _mesh(world)
        with AllocationTrace() as trace:  # no collective runs in here: no frees on gloo's threads to miss
            t0 = trace.mark()
            with torch.device("meta"):
                model = tiny_llama(seed=stage).eval()
            zerofx.compile(model, mesh, stage=stage)
            t1 = trace.mark()
        out = {"shard_peak": trace.peak_between(t0, t1) - trace.live_at(t0)}
        local = [t.to_local() if hasattr(t, "to_local") else t for t in model.state_dict().values()]
        out["local_bytes"] = sum(t.numel() * t.element_size() for t in local)
        read = []  # what the reader takes out of the files, request by request
        real = HuggingFaceStorageReader._process_read_request

        def counted(self, f, req, planner):
            read.append(math.prod(req.lengths) * planner.resolve_tensor(req).element_size())
            return real(self, f, req, planner)

        HuggingFaceStorageReader._process_read_request = counted
        try:
            zerofx.checkpoint.load_hf(f"{folder}/hf", model)
        finally:
            HuggingFaceStorageReader._process_read_request = real
        out["read_bytes"] = sum(read)
        with torch.device("meta"):
            unloaded = zerofx.compile(tiny_llama().eval(), mesh, stage=stage)
        try:
            with torch.no_grad():
                unloaded(input_ids=PROMPT)
            out["refused"] = None
        except zerofx.ZeroFXError as e:
            out["refused"] = str(e)
        out["unloaded"] = sorted(zerofx.sharding.runtime_of(model).unloaded)
        loaded = _full_state(model)
        out["params_equal"] = sorted(k for k in trained if torch.equal(loaded[k], trained[k]))
        out["rotary_equal"] = torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
        with torch.no_grad():
            out["tokens"] = _generate(model).tolist()
        return out

    for stage in stages:
        attempt(results, f"stage{stage}", lambda: one(stage))
    return results


# -- a custom accelerate loop ----------------------------------------------------------------------

ACCELERATE_STEPS = 3


def _accelerate_rows(world: int) -> torch.Tensor:
    """The rows the loop trains on, in order: micro-batch j of the global loop is the j-th block
    of world x per-rank rows (accelerate hands rank r the r-th per-rank batch of each block)."""
    return TokenDataset().ids[: ACCELERATE_STEPS * TRAINER_ACCUMULATION * TRAINER_PER_RANK * world]


def accelerate_reference(world: int) -> dict:
    """The plain loop in one process on each whole global micro-batch: what the ranks must match."""
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for j, ids in enumerate(_accelerate_rows(world).split(TRAINER_PER_RANK * world)):
        loss = model(input_ids=ids, labels=ids).loss
        (loss / TRAINER_ACCUMULATION).backward()
        losses.append(loss.item())
        if (j + 1) % TRAINER_ACCUMULATION == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            opt.zero_grad()
    return {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def accelerate_loop(world: int) -> dict:
    """One rank of a torchrun-launched job: accelerate's Accelerator and its accumulate() loop on
    a zerofx model prepared with zerofx.hf.prepare; per micro-step this rank's loss and the
    reduce-scatters its backward ran, per step the clipped global gradient norm."""
    from accelerate import Accelerator

    import zerofx
    from zerofx.hf import prepare

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=TRAINER_ACCUMULATION)
    model = zerofx.compile(tiny_llama(), _mesh(world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(_accelerate_rows(world), batch_size=TRAINER_PER_RANK)
    model, opt, loader = prepare(accelerator, model, opt, loader)
    losses, reduces, norms = [], [], []
    for ids in loader:
        with accelerator.accumulate(model):
            with zerofx.CollectiveCounter() as comm:
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
            losses.append(loss.item())
            reduces.append(comm.calls["reduce_scatter"])
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            opt.step()
            opt.zero_grad()
    return {
        "losses": losses,
        "reduces": reduces,
        "norms": norms,
        "params": _full_state(model),
        "saving": _rank0_only_saving(accelerator, model),
    }


def _rank0_only_saving(accelerator, model) -> dict:
    """What accelerate's and HF's rank-0 saving paths do with a sharded model: the messages of
    save_state, load_state and save_pretrained of its own shards (errors on every rank), and
    whether save_pretrained of whole tensors on every rank writes the trained weights."""
    import tempfile

    import torch.distributed as dist
    from safetensors.torch import load_file

    from zerofx import ZeroFXError

    out = {}
    folder = tempfile.mkdtemp(prefix="zerofx_accelerate_")
    for name, call in (
        ("save_state", lambda: accelerator.save_state(f"{folder}/state")),
        ("load_state", lambda: accelerator.load_state(f"{folder}/state")),
        ("save_pretrained", lambda: model.save_pretrained(f"{folder}/shards")),
    ):
        try:
            call()
            out[name] = ""
        except ZeroFXError as e:
            out[name] = str(e)
    whole = _full_state(model)
    model.save_pretrained(f"{folder}/whole", state_dict=whole, is_main_process=dist.get_rank() == 0)
    if dist.get_rank() == 0:
        written = load_file(f"{folder}/whole/model.safetensors")
        common = written.keys() & whole.keys()  # (HF may name a tied weight by either of its names)
        out["whole_written"] = len(common) >= len(whole) - 1 and all(torch.equal(written[k], whole[k]) for k in common)
    # accelerate's whole-model paths, on every rank: get_state_dict and save_model wrote rank 0's shards
    given = accelerator.get_state_dict(model)
    whole = _full_state(model)  # (save_pretrained may have dropped a tied weight's second name from the last)
    if dist.get_rank() == 0:  # the main process: whole tensors; the others nothing (as FSDP2's)
        out["get_state_dict_whole"] = given.keys() == whole.keys() and all(
            type(given[k]) is torch.Tensor and torch.equal(given[k], whole[k]) for k in whole
        )
    else:
        out["get_state_dict_whole"] = given == {}
    accelerator.save_model(model, f"{folder}/saved")  # (each rank's own folder: the main process writes)
    if dist.get_rank() == 0:
        written = load_file(f"{folder}/saved/model.safetensors")
        common = written.keys() & whole.keys()
        out["save_model_written"] = len(common) >= len(whole) - 1 and all(
            torch.equal(written[k], whole[k]) for k in common
        )
    return out
