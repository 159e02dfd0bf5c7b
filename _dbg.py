import sys; sys.path.insert(0,'bench')
import argparse, _common as c, torch, collections
from counts import OpCounter, _is_view
class L(OpCounter):
    def __init__(s): super().__init__(); s.names=collections.Counter()
    def __torch_dispatch__(s,func,types,args=(),kwargs=None):
        if not _is_view(func): s.names[str(func)]+=1
        return super().__torch_dispatch__(func,types,args,kwargs)
p=argparse.ArgumentParser(); c.add_model_args(p); a=p.parse_args(['--dtype','bfloat16','--layers','1','--seq','8','--batch','1'])
s=c.build_setup(a)
for row in sys.argv[1:]:
    ad=c.our_adapter(s,row,8); st=c.our_step(s,ad,merged=False); st.step()
    b=L(); 
    with b: c.base_step(s).step()
    m=L()
    with m: st.step()
    pm=c.peft_model(s,row,8); ps=c.peft_step(s,pm); ps.step(); pc=L()
    with pc: ps.step()
    print(row, m.ops-b.ops, pc.ops-b.ops)
    print(' ours', dict(m.names-b.names)); print(' peft', dict(pc.names-b.names))
