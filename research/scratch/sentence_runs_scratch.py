# PYTHONPATH=. python3 research/scratch/sentence_runs_scratch.py qwen2.5-0.5b fidelity:6,squad:12,musique:5 0.20 out.json  (session 31, AVX2-only EPYC)
"""Answer KL (teacher-forced on full prefill's greedy answer) and ROUGE-L of the greedy answers: QueryAware at
`ratio` with single tokens (shipped), in whole sentences (the selection before it became
QueryAware(sentence_runs=True)), and the order noise (full prefill, chunks reversed)."""

import json
import statistics
import sys

import torch

from benchmarks.common import MUSIQUE, SYSTEM, prompt_sets
from benchmarks.models import model_path
from ragblend import BlendEngine, Chunk, FullRecompute, FullReuse, QueryAware
from ragblend.core.calibration.metrics import answer_kl_steps, answer_logits
from ragblend.core.fusion.selection import QuestionAttention

try:
    from benchmarks.common import rouge_l
except ImportError:
    from benchmarks.fidelity import rouge_l


class Sentences(QuestionAttention):
    """A token's claim: the mean relevance of its sentence (inside its chunk), plus mix * its own."""

    def __init__(self, ratio, mix=0.0):
        super().__init__(ratio, cached_attention_scale=0.7)
        self.sentence_of, self.mix = None, mix

    def scores(self, prompt, relevance):
        own = relevance.sum(0).float()
        sid = self.sentence_of[prompt.reused_pos.cpu()]
        # sentences never cross spans: offset ids by chunk
        key = sid * 1000 + prompt.chunk_of.cpu()
        uniq, inv = torch.unique(key, return_inverse=True)
        sums = torch.zeros(len(uniq)).index_add_(0, inv, own.cpu())
        cnt = torch.zeros(len(uniq)).index_add_(0, inv, torch.ones_like(own.cpu()))
        return ((sums / cnt)[inv] + self.mix * own.cpu() + 1e-4 * own.cpu()).to(own.device)


torch.set_num_threads(2)
model, spec, ratio = sys.argv[1], sys.argv[2], float(sys.argv[3])
engine = BlendEngine.from_pretrained(model_path(model), kv_dir=False)
enders = {i for i in range(len(engine.tokenizer)) if any(c in engine.tokenizer.decode([i]) for c in ".?!\n")}
sent = Sentences(ratio)
sent_half = Sentences(ratio, mix=1.0)
variants = {"shipped": QueryAware(ratio), "sentences": sent, "noise": FullRecompute()}

out_json = sys.argv[4]
raw = {}
res = {k: [] for k in variants}
for name, ps in prompt_sets(spec.split(","), MUSIQUE).items():
    for p in ps:
        engine.precompute(p.chunks)
        segs = [Chunk(c) for c in p.chunks] + [p.question]
        ids0 = engine.prefill(segs, system=SYSTEM, strategy=FullReuse()).token_ids
        ends = torch.tensor([t in enders for t in ids0], dtype=torch.long)
        sid = torch.cat([torch.zeros(1, dtype=torch.long), ends.cumsum(0)[:-1]])
        sent.sentence_of = sent_half.sentence_of = sid
        ref = engine.generate(segs, system=SYSTEM, strategy=FullRecompute(), max_new_tokens=32)
        refl = answer_logits(engine, engine.prefill(segs, system=SYSTEM, strategy=FullRecompute()), ref.token_ids)
        row = {}
        rsegs = [Chunk(c) for c in reversed(p.chunks)] + [p.question]
        for k, s in variants.items():
            sg = rsegs if k == "noise" else segs
            g = engine.generate(sg, system=SYSTEM, strategy=s, max_new_tokens=32)
            pre = engine.prefill(sg, system=SYSTEM, strategy=s)
            kl = float(answer_kl_steps(refl, answer_logits(engine, pre, ref.token_ids, decoding_bias=False)).mean())
            res[k].append((kl, rouge_l(g.text, ref.text)))
            row[k] = (round(kl, 4), round(rouge_l(g.text, ref.text), 2))
        print(name, row, flush=True)
        raw.setdefault(name, []).append(row)
        open(out_json, "w").write(json.dumps(raw))
print(json.dumps(raw))
for k, v in res.items():
    kls = [a for a, _ in v]
    rs = [b for _, b in v]
    print(
        k,
        "answer KL mean",
        round(statistics.mean(kls), 4),
        "median",
        round(statistics.median(kls), 4),
        "ROUGE-L",
        round(statistics.mean(rs), 2),
    )
