"""Strata engine: the runtime layer (one model on one device).

    from services.engine import LLM, SamplingParams
    llm = LLM(model_dir, block_size=16, max_num_seqs=64)
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from services.engine.config import EngineArgs
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from services.engine.lora import LoRARequest
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "LLMEngine", "LoRARequest", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput",
           "InvalidRequestError"]
