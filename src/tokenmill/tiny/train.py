"""Train the bundled tiny Qwen3 model on the Python standard library (offline on any machine).

Data: every `*.py` of the running interpreter's stdlib outside site-packages (and outside test folders
unless `--with-tests`) as raw source, plus ChatML dialogues "explain the function NAME" -> its docstring,
so the chat template leads to text. Files whose path hashes to 0 mod `--val-every-nth` form the validation split.
With `--eval-every N` the validation loss is measured every N steps and the best weights, not the last, are saved;
`--patience P` stops the run once P evaluations in a row have not improved on the best.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import sysconfig
import time

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_files(max_files: int | None = None, with_tests: bool = False) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    skip = _SKIP_DIRS if with_tests else _SKIP_DIRS | _TEST_DIRS
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return out[:max_files] if max_files else out


def chat_samples(source: str) -> list[str]:
    """ChatML dialogues asking to explain each documented function or class of one source file."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 20 and not node.name.startswith("_"):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                out.append(f"<|im_start|>user\nexplain the {kind} {node.name}<|im_end|>\n"
                           f"<|im_start|>assistant\n{doc.strip()}<|im_end|>\n")
    return out


def load_corpus(max_files: int | None, val_every_nth: int, with_tests: bool = False) -> dict[str, dict[str, list[str]]]:
    splits = {"train": {"code": [], "chat": []}, "val": {"code": [], "chat": []}}
    for path in stdlib_files(max_files, with_tests):
        try:
            with open(path, encoding="utf-8") as f:
                src = f.read()
        except (UnicodeDecodeError, OSError):
            continue
        rel = os.path.relpath(path, sysconfig.get_paths()["stdlib"])
        split = "val" if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % val_every_nth == 0 else "train"
        splits[split]["code"].append(src)
        splits[split]["chat"] += chat_samples(src)
    return splits


def train_tokenizer(texts: list[str], vocab_size: int, out: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    fast.save_pretrained(out)
    return fast


def encode_stream(tok, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream, each ended by <|endoftext|>."""
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


def build_streams(tok, corpus: dict[str, dict[str, list[str]]], seq_len: int) -> dict[str, list[torch.Tensor]]:
    """Per split, the (code, chat) token streams; a stream too short for one window borrows the other split's."""
    streams = {s: [encode_stream(tok, corpus[s]["code"]), encode_stream(tok, corpus[s]["chat"])] for s in corpus}
    for s in ("val", "train"):   # a tiny --max-files run may leave one split too short: fall back
        for i, t in enumerate(streams[s]):
            if len(t) <= seq_len + 1:
                streams[s][i] = streams["train" if s == "val" else "val"][i]
    return streams


def sample_batch(streams: list[torch.Tensor], weights: list[float], batch_size: int, seq_len: int,
                 gen: torch.Generator) -> torch.Tensor:
    rows = []
    for _ in range(batch_size):
        s = streams[int(torch.multinomial(torch.tensor(weights), 1, generator=gen))]
        start = int(torch.randint(0, len(s) - seq_len - 1, (1,), generator=gen))
        rows.append(s[start:start + seq_len + 1])
    return torch.stack(rows)


def build_model(vocab_size: int, eos_id: int, pad_id: int, args):
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=args.hidden_size,
                      intermediate_size=args.intermediate_size, num_hidden_layers=args.num_layers,
                      num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=2048, rope_theta=10000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=eos_id, bos_token_id=None,
                      pad_token_id=pad_id)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    return model


def lr_at(step: int, progress: float, args) -> float:
    """Linear warmup over `--warmup` steps, then cosine decay to 10% of the peak as `progress` goes 0 -> 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model, streams, weights, args, device, amp) -> float:
    """Mean loss on `--eval-batches` batches drawn by a fixed seed, so every call sees the same batches."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(args.eval_batches):
        x = sample_batch(streams, weights, args.batch_size, args.seq_len, gen).to(device)
        with amp():
            losses.append(float(_loss(model, x)))
    model.train()
    return sum(losses) / len(losses)


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))


class BestWeights:
    """Validation-loss history and a CPU copy of the weights with the lowest loss so far. `should_stop` turns
    true once `patience` (> 0) evaluations in a row have not improved on the best."""

    def __init__(self, patience: int):
        self.patience = patience
        self.history: list[dict] = []
        self.best_step: int | None = None
        self.best_val_loss = math.inf
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.evals_since_best = 0

    def update(self, step: int, val_loss: float, model) -> bool:
        self.history.append({"step": step, "val_loss": round(val_loss, 4)})
        if val_loss < self.best_val_loss:
            self.best_step, self.best_val_loss, self.evals_since_best = step, val_loss, 0
            self.state_dict = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            return True
        self.evals_since_best += 1
        return False

    @property
    def should_stop(self) -> bool:
        return self.patience > 0 and self.evals_since_best >= self.patience


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="train the bundled tiny Qwen3 model on the Python stdlib")
    p.add_argument("--out", required=True, help="output directory (model + tokenizer)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this wall time too; the LR schedule follows whichever of steps or time "
                        "runs out first, so a busy machine still gets a full cosine decay")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chat-fraction", type=float, default=0.4, help="share of training rows drawn from dialogues")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N stdlib files")
    p.add_argument("--with-tests", action="store_true", help="also train on the stdlib's test suites (2.5x the code)")
    p.add_argument("--val-every-nth", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=0,
                   help="measure the validation loss every N steps and at the end, and save the best weights "
                        "instead of the last (0: off, evaluate only at the end)")
    p.add_argument("--patience", type=int, default=0,
                   help="stop once the validation loss has not improved for this many evaluations (0: off; "
                        "needs --eval-every)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.eval_every < 0 or args.patience < 0:
        p.error("--eval-every and --patience must be >= 0")
    if args.patience and not args.eval_every:
        p.error("--patience needs --eval-every")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)

    corpus = load_corpus(args.max_files, args.val_every_nth, args.with_tests)
    tok = train_tokenizer(corpus["train"]["code"] + corpus["train"]["chat"], args.vocab_size, args.out)
    streams = build_streams(tok, corpus, args.seq_len)
    weights = [1 - args.chat_fraction, args.chat_fraction]
    ntok = {s: [len(t) for t in streams[s]] for s in streams}
    print(f"data: {ntok} tokens (code, chat) per split; tokenizer {len(tok)} ids; {time.time() - t0:.1f}s",
          flush=True)

    model = build_model(len(tok), tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"),
                        args).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.2f} M parameters on {device}", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    use_bf16 = device.type == "cuda"

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else torch.autocast("cpu", enabled=False)

    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t_train = time.time()
    loss_ema = None
    budget_s = args.max_minutes * 60 if args.max_minutes else None
    best = BestWeights(args.patience) if args.eval_every else None
    done, stopped_early = 0, False

    def eval_val():   # `step` in the history is the number of optimizer steps taken
        v = evaluate(model, streams["val"], weights, args, device, amp)
        improved = best.update(done, v, model)
        print(f"eval  step {done:5d}  val loss {v:.4f}{'  (best)' if improved else ''}  "
              f"best {best.best_val_loss:.4f} @ {best.best_step}  {time.time() - t_train:.0f}s", flush=True)

    for step in range(args.steps):
        elapsed = time.time() - t_train
        if budget_s is not None and elapsed >= budget_s:
            break
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        if budget_s is not None:       # whichever runs out first, steps or time, ends the decay
            progress = max(progress, elapsed / budget_s)
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(streams["train"], weights, args.batch_size, args.seq_len, gen).to(device, non_blocking=True)
        with amp():
            loss = _loss(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done += 1
        if step % args.log_every == 0 or step == args.steps - 1:
            v = loss.item()
            loss_ema = v if loss_ema is None else 0.9 * loss_ema + 0.1 * v
            print(f"step {step:5d}  loss {v:.4f}  lr {lr:.2e}  {time.time() - t_train:.0f}s",
                  flush=True)
        if best is not None and done % args.eval_every == 0:
            eval_val()
            if best.should_stop:
                print(f"early stop at step {done}: no improvement for {args.patience} evaluations", flush=True)
                stopped_early = True
                break
    if best is not None:
        if not best.history or best.history[-1]["step"] != done:
            eval_val()
        if best.state_dict is not None:   # None only if every validation loss was NaN
            model.load_state_dict(best.state_dict)
    train_loss = evaluate(model, streams["train"], weights, args, device, amp)
    val_loss = evaluate(model, streams["val"], weights, args, device, amp)
    wall = time.time() - t_train
    kept = f"  (weights of step {best.best_step})" if best is not None else ""
    print(f"final: {done} steps  train loss {train_loss:.4f}  val loss {val_loss:.4f}  train wall {wall:.0f}s{kept}",
          flush=True)

    model.to(getattr(torch, args.save_dtype))
    model.config.dtype = getattr(torch, args.save_dtype)
    model.save_pretrained(args.out, safe_serialization=True)
    stats = {"parameters": nparams, "steps": done, "train_loss": round(train_loss, 4), "val_loss": round(val_loss, 4),
             "train_wall_s": round(wall, 1), "tokens": ntok, "args": vars(args)}
    if best is not None:   # train_loss/val_loss above are then those of the saved (best) weights
        stats.update(best_step=best.best_step, best_val_loss=round(best.best_val_loss, 4), val_history=best.history,
                     stopped_early=stopped_early)
    with open(os.path.join(args.out, "training_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    return stats


if __name__ == "__main__":
    main()
