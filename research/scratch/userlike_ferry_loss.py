# PYTHONPATH=. python3 research/scratch/userlike_ferry_loss.py  (2026-12-06, 2-core AVX-512 EPYC, SmolLM2)
"""Issue 59's lost answer at 600-1,200 tokens, rebuilt with benchmarks.userlike's own code (the sample
documents at 256-token chunks, top 3, the demo's "What is the name of the passenger ferry that goes
to Hallow Holm?", 781 tokens): where the answer and the distractor lie, where the question's
attention (QueryAware's first stage) and the V deviation (CacheBlend's) point, and which tokens,
recomputed on top of QueryAware(0.1), bring "Sanderling" back instead of "LCT app"."""

import torch

from benchmarks.common import GREEDY_TOKENS
from benchmarks.models import model_path
from benchmarks.userlike import Index, sample_corpus
from ragblend import BlendEngine, BlendLLM, CacheBlend, FullRecompute, QueryAware
from ragblend.core.fusion.selection import QuestionAttention, TopScoreSelection, kv_deviation
from ragblend.integrations.local_index import default_embed_model

engine = BlendEngine.from_pretrained(model_path("smollm2"), kv_dir=False, prefix_cache_bytes=0)
documents, questions = sample_corpus()
llm = BlendLLM(engine=engine, max_new_tokens=GREEDY_TOKENS)
question = [q["question"] for q in questions if "ferry that goes" in q["question"]][0]
Index(engine, documents, 256, default_embed_model()).query_engine(llm, 3).query(question)
call = llm.calls[-1]
layout = call.layout if call.layout is not None else engine.find_chunks(call.prompt)
ids, spans = layout.token_ids, [(s.start, s.end) for s in layout.chunk_spans]
print(f"{len(ids)} tokens, chunks at {spans}")


def find(text: str) -> list[int]:
    piece = engine.tokenize(text)
    return [i for i in range(len(ids)) if ids[i:i + len(piece)] == piece]


for text in (" Sanderling", " LCT"):
    print(f"{text!r} at {find(text)}")


def answer(strategy) -> str:
    return engine.generate(layout, strategy=strategy, max_new_tokens=24).text


class Recorded(QuestionAttention):
    """QueryAware's selection, keeping the question's relevance; ``extra(prompt)``: more positions."""

    def __init__(self, ratio, extra=lambda prompt: ()):
        super().__init__(ratio, cached_attention_scale=0.7)
        self.extra = extra

    def first(self, prompt, probe):
        self.relevance, self.prompt = probe(), prompt
        selected = super().first(prompt, lambda: self.relevance)
        for position in self.extra(prompt):
            selected[position] = True
        return selected


print("full prefill:", answer(FullRecompute()))
recorded = Recorded(0.1)
print("QueryAware(0.1):", answer(recorded))
summed, prompt = recorded.relevance.sum(0), recorded.prompt
rank = torch.argsort(torch.argsort(summed, descending=True))
print("question's attention per chunk:", [round(float(summed[prompt.chunk_of == c].sum() / summed.sum()), 3)
                                          for c in range(len(spans))])
for position in find(" Sanderling") + find(" LCT"):
    row = int((prompt.reused_pos == position).nonzero()[0])
    print(f"  rank of position {position} ({engine.tokenizer.decode([ids[position]])!r}): {int(rank[row])} "
          f"of {prompt.num_reused}")
top = torch.argsort(summed, descending=True)[:20]
print("  its top 20:", [engine.tokenizer.decode([ids[int(prompt.reused_pos[i])]]) for i in top])

for ratio in (0.3, 0.4, 0.45, 0.5, 0.6):
    print(f"QueryAware({ratio}):", answer(QueryAware(ratio)))
print("CacheBlend(0.15):", answer(CacheBlend(0.15)), "| CacheBlend(0.3):", answer(CacheBlend(0.3)))


class Deviation(TopScoreSelection):
    def refine(self, prompt, step):
        reused = prompt.reused.to(step.positions.device)[step.positions]
        rows = torch.searchsorted(prompt.reused_pos, step.positions[reused])
        self.deviation = kv_deviation("value", step.fresh_k[:, reused], step.fresh_v[:, reused], step.cached, rows)
        self.chunk_of = prompt.chunk_of[rows]
        return super().refine(prompt, step)


deviation = Deviation({1: 0.15})
answer(deviation)
print("mean V deviation at layer 1 per chunk:",
      [round(float(deviation.deviation[deviation.chunk_of == c].mean()), 4) for c in range(len(spans))])

middle = spans[1]
extras = {
    "the answer's chunk whole": lambda p: range(*middle),
    "its first half": lambda p: range(middle[0], (middle[0] + middle[1]) // 2),
    "its second half (the answer's sentence in it)": lambda p: range((middle[0] + middle[1]) // 2, middle[1]),
    "the first 16 tokens of every chunk": lambda p: [i for a, _ in spans for i in range(a, a + 16)],
    "the first 32 tokens of every chunk but the first": lambda p: [i for a, _ in spans[1:] for i in range(a, a + 32)],
    "the last 16 tokens of every chunk": lambda p: [i for _, b in spans for i in range(b - 16, b)],
}
for name, extra in extras.items():
    print(f"QueryAware(0.1) + {name}:", answer(Recorded(0.1, extra)))
