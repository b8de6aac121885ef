"""LoRA settings (`--lora NAME=PATH`, the slots): part of every EngineConfig, so `duet worker`,
`duet generate` and the gateway's local backend take them. No torch import here."""
from __future__ import annotations

import re
from dataclasses import dataclass

from shared.settings.spec import check_values, setting

MAX_RANK = 64  # the kernels pad a rank to its tile; larger adapters are refused
DEFAULT_SLOTS = 4  # device slots when --lora names adapters and --max-loras is not given
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def check_adapter_name(name: str) -> str:
    """An adapter name clients may send as `model`: letters, digits and ._:/@+- (no spaces)."""
    if not NAME_RE.match(name):
        raise ValueError(f"LoRA adapter name {name!r} must be 1-128 characters of letters, digits and ._:/@+-, "
                         "starting with a letter or digit")
    return name


def parse_adapter(text: str) -> tuple[str, str]:
    """'NAME=PATH' -> (NAME, PATH)."""
    name, sep, path = text.partition("=")
    if not sep or not path.strip():
        raise ValueError(f"--lora takes NAME=PATH (a PEFT adapter folder), got {text!r}")
    return check_adapter_name(name.strip()), path.strip()


@dataclass
class LoraConfig:
    adapters: list[str] = setting(
        (), flag="--lora", env="DUET_LORA", repeat=True,
        help="serve a LoRA adapter: NAME=PATH, PATH a PEFT folder (adapter_config.json + "
             "adapter_model.safetensors); clients pick it with model=NAME; repeatable (the variable: comma-separated)")
    max_loras: int = setting(
        0, flag="--max-loras", env="DUET_MAX_LORAS",
        help=f"adapter slots on the device: how many adapters one step mixes (0: {DEFAULT_SLOTS} when --lora names "
             "an adapter, else LoRA is off; give it to load adapters at run time only)")
    max_lora_rank: int = setting(
        16, flag="--max-lora-rank", env="DUET_MAX_LORA_RANK",
        help=f"largest adapter rank served (at most {MAX_RANK}); sizes every slot")
    max_cpu_loras: int = setting(
        0, flag="--max-cpu-loras", env="DUET_MAX_CPU_LORAS",
        help="adapters kept in host memory, least recently used out (0: twice the device slots); an adapter "
             "not held is read from its folder again when a request needs it")

    def __post_init__(self) -> None:
        check_values(self)
        self.named()  # NAME=PATH each, names unique
        if not 1 <= self.max_lora_rank <= MAX_RANK:
            raise ValueError(f"--max-lora-rank must be in 1..{MAX_RANK}, got {self.max_lora_rank}")
        if self.max_loras < 0 or self.max_cpu_loras < 0:
            raise ValueError("--max-loras and --max-cpu-loras must not be negative")

    def named(self) -> dict[str, str]:
        """The start-up adapters, name -> folder."""
        out: dict[str, str] = {}
        for text in self.adapters:
            name, path = parse_adapter(text)
            if name in out:
                raise ValueError(f"--lora names adapter {name!r} twice")
            out[name] = path
        return out

    @property
    def slots(self) -> int:
        """Device slots (0: LoRA off)."""
        return self.max_loras or (DEFAULT_SLOTS if self.adapters else 0)

    @property
    def host_slots(self) -> int:
        return max(self.max_cpu_loras or 2 * self.slots, self.slots)
