import sys, torch, hashlib
from parity.optim.muon import newton_schulz, fp32_matmul_precision, orthogonalize
from parity.model import matmul
torch.manual_seed(1)
h=hashlib.sha256()
for prec in ("medium","highest"):
    for shape in [(128,128),(384,128),(128,256),(256,128),(7,300),(64,33)]:
        for scale in (1.0, 1e-30, 1e30):
            x=(torch.randn(*shape)*scale)
            with fp32_matmul_precision(prec):
                y=newton_schulz(x)
                z=orthogonalize(x, qkv_split_shapes=None)
            h.update(y.view(torch.int32).numpy().tobytes()); h.update(z.view(torch.int32).numpy().tobytes())
a=torch.randn(64,48).bfloat16(); b=torch.randn(48,32).bfloat16(); c=torch.randn(64,32).bfloat16()
for al,be in ((1.0,0.5),(-1.5,2.0),(1.0,0.0),(2.0,1.0)):
    h.update(matmul.addmm(c,a,b,beta=be,alpha=al).view(torch.int16).numpy().tobytes())
h.update(matmul.mm(a,b).view(torch.int16).numpy().tobytes())
print(h.hexdigest())
