"""Built-in simple stages (the quickstart): prompt source, rule-based generator (a
placeholder for the real engines), verifier, counting sink. Registered by name in
``dora.registry``."""

from dora.stages.counting_sink import CountingSink
from dora.stages.prompt_source import PromptSource
from dora.stages.rule_generator import RuleGenerator
from dora.stages.verifier import VerifierStage

__all__ = ["CountingSink", "PromptSource", "RuleGenerator", "VerifierStage"]
