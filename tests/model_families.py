"""Model families the torch emulation is checked on, built from code and configs (no downloads).

``resnet18`` is torchvision's ResNet-18 (torchvision/models/resnet.py: BasicBlock, its
initialisation) written out, since torchvision is not installed here; the transformers families
(Llama, BERT, T5, ViT, GPT-2 with ``F.scaled_dot_product_attention``) are their real classes from
small configs; ``lstm`` a torch ``nn.LSTM`` language model.  Each entry gives the model and a loss
for step ``index`` (seeded batches).
"""

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18(nn.Module):
    """torchvision.models.resnet18(weights=None, num_classes=...), layer for layer."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1, self.layer2 = self._layer(64, 1), self._layer(128, 2)
        self.layer3, self.layer4 = self._layer(256, 2), self._layer(512, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.constant_(module.weight, 1)
                nn.init.constant_(module.bias, 0)

    def _layer(self, planes, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        first = BasicBlock(self.inplanes, planes, stride, downsample)
        self.inplanes = planes
        return nn.Sequential(first, BasicBlock(planes, planes))

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _generator(index):
    return torch.Generator().manual_seed(index)


def resnet18(batch=2, size=32):
    model = ResNet18()

    def loss(model, index):
        generator = _generator(index)
        images = torch.randn(batch, 3, size, size, generator=generator)
        labels = torch.randint(0, 10, (batch,), generator=generator)
        return nn.functional.cross_entropy(model(images).float(), labels)
    return model, loss


VOCAB, TOKENS = 128, 16


def _ids(index, batch=2):
    return torch.randint(0, VOCAB, (batch, TOKENS), generator=_generator(index))


def _causal_lm(model):
    def loss(model, index):
        ids = _ids(index)
        return model(input_ids=ids, labels=ids).loss.float()
    return model, loss


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _causal_lm(LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)))


def gpt2_sdpa():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    config._attn_implementation = "sdpa"  # F.scaled_dot_product_attention in every block
    return _causal_lm(GPT2LMHeadModel(config))


def bert():
    from transformers import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=64))

    def loss(model, index):
        ids = _ids(index)
        return model(input_ids=ids, labels=ids).loss.float()
    return model, loss


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_heads=4, decoder_start_token_id=0))

    def loss(model, index):
        ids = _ids(index)
        return model(input_ids=ids, labels=ids.flip(-1)).loss.float()
    return model, loss


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    model = ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=128, num_labels=10))

    def loss(model, index):
        generator = _generator(index)
        images = torch.randn(2, 3, 32, 32, generator=generator)
        return model(pixel_values=images, labels=torch.randint(0, 10, (2,), generator=generator)).loss.float()
    return model, loss


class LSTMLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(VOCAB, 32), nn.LSTM(32, 64, num_layers=2, batch_first=True), \
            nn.Linear(64, VOCAB)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


def lstm():
    model = LSTMLanguageModel()

    def loss(model, index):
        ids = _ids(index)
        logits = model(ids[:, :-1]).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return model, loss


FAMILIES = {"resnet18": resnet18, "llama": llama, "gpt2_sdpa": gpt2_sdpa, "bert": bert, "t5": t5, "vit": vit,
            "lstm": lstm}
