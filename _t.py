import peft, torch, warnings, json
warnings.simplefilter("ignore")
from tests.models import tiny_model
from safetensors.torch import load_file
m=tiny_model('llama')
from peft.tuners.lora.config import MontecloraConfig
pm=peft.get_peft_model(m, peft.LoraConfig(target_modules=['q_proj'], r=4, monteclora_config=MontecloraConfig(num_samples=3, buffer_size=2)))
print([n for n,p in pm.named_parameters() if p.requires_grad][:6])
pm.save_pretrained('/tmp/mc')
print({k:v.shape for k,v in load_file('/tmp/mc/adapter_model.safetensors').items()})
print(json.load(open('/tmp/mc/adapter_config.json'))['monteclora_config'])
