import transformer_engine.pytorch
import torch, os, sys
torch.manual_seed(0)
b,s,h,d=4,1024,16,64
q,k,v=(torch.randn(b,s,h,d,device="cuda",dtype=torch.bfloat16) for _ in range(3))
ref=torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1,2).float() for t in (q,k,v)),is_causal=True).transpose(1,2)
def rel(x): x=x.float(); return ((x-ref).norm()/ref.norm()).item(), x.abs().max().item()
try:
    from flash_attn.cute import flash_attn_func
    o=flash_attn_func(q,k,v,causal=True); o=o[0] if isinstance(o,tuple) else o
    print("FA4 direct causal", rel(o))
    o=flash_attn_func(q,k,v,causal=False); o=o[0] if isinstance(o,tuple) else o
    r2=torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1,2).float() for t in (q,k,v))).transpose(1,2)
    print("FA4 direct no causal", ((o.float()-r2).norm()/r2.norm()).item())
except Exception as e: print("FA4 direct error", repr(e)[:300])
os.environ.update(NVTE_FLASH_ATTN="1",NVTE_FUSED_ATTN="0",NVTE_UNFUSED_ATTN="0")
import transformer_engine.pytorch as te
m=te.DotProductAttention(h,d,attn_mask_type="causal",qkv_format="bshd")
o=m(q,k,v).view(b,s,h,d); print("TE flash bshd", rel(o))
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa
print({k:v for k,v in dpa._attention_backends.items() if k!="attention_params"})
qs,ks,vs=(t.transpose(0,1).contiguous() for t in (q,k,v))
m=te.DotProductAttention(h,d,attn_mask_type="causal",qkv_format="sbhd")
o=m(qs,ks,vs).view(s,b,h,d).transpose(0,1); print("TE flash sbhd", rel(o))
r2=torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1,2).float() for t in (q,k,v))).transpose(1,2)
m=te.DotProductAttention(h,d,attn_mask_type="no_mask",qkv_format="bshd")
o=m(q,k,v).view(b,s,h,d).float(); print("TE flash bshd no_mask", ((o-r2).norm()/r2.norm()).item(), o.abs().max().item())
m.eval()
with torch.no_grad():
    o=m(q,k,v).view(b,s,h,d).float(); print("TE flash bshd no_mask eval", ((o-r2).norm()/r2.norm()).item(), o.abs().max().item())
import importlib.metadata as md; print("versions", md.version("flash-attn-4"), te.__version__ if hasattr(te,"__version__") else "")
import inspect
from transformer_engine.pytorch.attention.dot_product_attention import backends
src=inspect.getsource(backends)
i=src.find("flash_attn_func_v4"); print("TE src:", src[i-200:i+600].replace("\n"," | ")[:800] if i>=0 else "no v4 name")
