"""Agreement of attention_reference with the naive float64 formula on CUDA: five shapes (GQA, cross-attention,
a window, forced small tiles). Run on the H200 as `PYTHONPATH=$PWD python3 benchmarks/check_reference_cuda.py`
(output: h200/check-reference-cuda.txt). Prints OK when every tensor agrees to 1e-12 relative.
"""
import torch, math, time
from attn_doctor.reference import attention_reference, naive_reference
torch.manual_seed(0)
shapes = [(2,300,300,8,2,64,True,None,1<<16),(1,513,700,4,4,128,False,None,1<<18),(2,256,256,4,1,32,False,(40,7),None),(1,1024,1024,16,16,128,True,None,None),(1,2048,2048,4,2,128,True,None,1<<20)]
for b,sq,sk,h,hk,d,causal,window,bb in shapes:
    q=torch.randn(b,sq,h,d,device="cuda").to(torch.bfloat16); k=torch.randn(b,sk,hk,d,device="cuda").to(torch.bfloat16)
    v=torch.randn(b,sk,hk,d,device="cuda").to(torch.bfloat16); do=torch.randn(b,sq,h,d,device="cuda").to(torch.bfloat16)
    got=attention_reference(q,k,v,do,causal=causal,softmax_scale=d**-0.5,window=window,block_bytes=bb)
    want=naive_reference(q,k,v,do,causal=causal,softmax_scale=d**-0.5,window=window)
    errs={n: float((getattr(got,n)-getattr(want,n)).norm()/getattr(want,n).norm()) for n in ("out","dq","dk","dv")}
    print((b,sq,sk,h,hk,d,causal,window,bb), {n: f"{e:.1e}" for n,e in errs.items()}, "OK" if max(errs.values())<1e-12 else "MISMATCH")
