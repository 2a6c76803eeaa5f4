"""qkv generate's default path (load_for_generation("smollm2"): int8, compiled) against llama.cpp
(llama-cpp-python) on the same GGUF file: 32-token prompt, 64 greedy tokens, 2 threads, 4
alternating rounds, medians and their ratio. Needs llama-cpp-python (see the README)."""
import time, statistics, torch
from qkv.runtime.prepare import load_for_generation
from qkv.generation import generate, warm_up
from qkv.models.loader import smollm2_path
from llama_cpp import Llama
torch.set_num_threads(2)
model, tok, setup = load_for_generation("smollm2")
t=time.time(); warm_up(model); print("qkv", setup.describe(), "warm-up %.1fs" % (time.time()-t), flush=True)
text="The key to attention is a question each token asks of every other: how much do you matter to me? The answers are weights"
ids = torch.tensor([tok.encode(text).ids[:32]])
llm = Llama(model_path=str(smollm2_path()), n_threads=2, n_ctx=512, verbose=False)
N=64
def run_qkv():
    t=time.perf_counter(); generate(model, ids, N); return N/(time.perf_counter()-t)
def run_llama():
    llm.reset(); t=time.perf_counter(); n=0
    for tkn in llm.generate(ids[0].tolist(), temp=0.0, top_k=1):
        n+=1
        if n==N: break
    return N/(time.perf_counter()-t)
q,l=[],[]
for r in range(4):
    q.append(run_qkv()); l.append(run_llama()); print(r, "qkv %.1f tok/s  llama.cpp %.1f tok/s" % (q[-1], l[-1]), flush=True)
print("median qkv %.1f  llama.cpp %.1f  ratio %.2f" % (statistics.median(q), statistics.median(l), statistics.median(q)/statistics.median(l)))
