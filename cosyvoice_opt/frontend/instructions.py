"""CosyVoice3's instructions for instruct2 mode, as data: upstream's trained list (`instruct_list` in
`cosyvoice/utils/common.py`), each under a short name a UI or API can offer. Free-text instructions work too.

Upstream writes each one as `"You are a helpful assistant. <instruction><|endofprompt|>"`; the engine adds that
frame itself (`tokenizer.prompt_text_for`), so a preset is only the instruction.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM_PROMPT = "You are a helpful assistant."  # the system text of every upstream CosyVoice3 example


@dataclass(frozen=True)
class Instruction:
    name: str
    kind: str  # "dialect", "volume", "speed", "emotion" or "role"
    text: str  # what the model reads, as trained


_DIALECTS = (
    ("cantonese", "广东"), ("northeastern", "东北"), ("gansu", "甘肃"), ("guizhou", "贵州"), ("henan", "河南"),
    ("hubei", "湖北"), ("hunan", "湖南"), ("jiangxi", "江西"), ("minnan", "闽南"), ("ningxia", "宁夏"),
    ("shanxi", "山西"), ("shaanxi", "陕西"), ("shandong", "山东"), ("shanghainese", "上海"), ("sichuanese", "四川"),
    ("tianjin", "天津"), ("yunnan", "云南"),
)  # fmt: skip

INSTRUCTIONS: tuple[Instruction, ...] = (
    *(Instruction(name, "dialect", f"请用{place}话表达。") for name, place in _DIALECTS),
    Instruction("loud", "volume", "Please say a sentence as loudly as possible."),
    Instruction("soft", "volume", "Please say a sentence in a very soft voice."),
    Instruction("slow", "speed", "请用尽可能慢地语速说一句话。"),
    Instruction("fast", "speed", "请用尽可能快地语速说一句话。"),
    Instruction("happy", "emotion", "请非常开心地说一句话。"),
    Instruction("sad", "emotion", "请非常伤心地说一句话。"),
    Instruction("angry", "emotion", "请非常生气地说一句话。"),
    Instruction("peppa-pig", "role", "我想体验一下小猪佩奇风格，可以吗？"),
    Instruction("robot", "role", "你可以尝试用机器人的方式解答吗？"),
)
INSTRUCTIONS_BY_NAME: dict[str, Instruction] = {i.name: i for i in INSTRUCTIONS}


def resolve_instruction(text: str) -> str:
    """A preset's name (`"sichuanese"`, `"fast"`) becomes its instruction; anything else is a free-text
    instruction and stays as written."""
    preset = INSTRUCTIONS_BY_NAME.get(text.strip().lower())
    return preset.text if preset else text
