"""The conformance kit: checks a plugin of any seam against its contract, without a GPU.

One plain function per seam, for a plugin author's own pytest; each runs every check of its
seam and returns a report, or raises :class:`ConformanceError` whose message names the broken
invariant (``scheduler invariant 'handed out exactly once or answered' broken: request 'r7' was
never handed out nor answered (seed 0)``)::

    from fd_core.testing.conformance import check_scheduler

    def test_my_scheduler_conforms():
        check_scheduler(MyScheduler)

=====================  ============================================  ===========================
seam                   function                                      what it drives
=====================  ============================================  ===========================
scheduler              :func:`check_scheduler`                       puts, gets, threads, hooks
resource manager       :func:`check_resource_manager`                a seeded simulated engine
token processor        :func:`check_token_processor`                 hand-made plans and results
platform               :func:`check_platform`                        detect and every method
connector              :func:`check_connector`                       loopback transport, hand-off
model architecture     :func:`check_architecture`                    tiny random models vs transformers
guided decoding        :func:`check_guided_decoding`                 a small vocabulary, walks along masks
tool parser            :func:`check_tool_parser`                     its sample replies, every split
reasoning parser       :func:`check_reasoning_parser`                its sample replies, every split
speculative proposer   :func:`check_proposer`                        seeded simulated steps
=====================  ============================================  ===========================

``run_<seam>_checks`` run the same checks without raising (one :class:`CheckResult` per check,
what ``fd-serve plugins check`` prints); :func:`run_plugin_checks` does so for a loaded plugin
class and its config options. docs/conformance.md lists every invariant.
"""

from fd_core.testing.conformance._report import (
    CheckResult,
    ConformanceError,
    SeamReport,
)
from fd_core.testing.conformance.architecture import (
    ARCHITECTURE_CHECKS,
    check_architecture,
    run_architecture_checks,
)
from fd_core.testing.conformance.connector import (
    CONNECTOR_CHECKS,
    check_connector,
    run_connector_checks,
)
from fd_core.testing.conformance.guided_decoding import (
    GUIDED_DECODING_CHECKS,
    check_guided_decoding,
    kit_vocabulary,
    run_guided_decoding_checks,
)
from fd_core.testing.conformance.peer_directory import (
    InMemoryPeerDirectory,
    PeerBoard,
    directory_scheduler,
)
from fd_core.testing.conformance.platform import (
    PLATFORM_CHECKS,
    check_platform,
    run_platform_checks,
)
from fd_core.testing.conformance.plugin_check import check_names, run_plugin_checks
from fd_core.testing.conformance.proposer import (
    PROPOSER_CHECKS,
    check_proposer,
    run_proposer_checks,
)
from fd_core.testing.conformance.reasoning_parser import (
    REASONING_PARSER_CHECKS,
    check_reasoning_parser,
    run_reasoning_parser_checks,
)
from fd_core.testing.conformance.resource_manager import (
    DEFAULT_LIMITS,
    ConformanceReport,
    check_resource_manager,
    run_resource_manager_checks,
)
from fd_core.testing.conformance.scheduler import (
    SCHEDULER_CHECKS,
    check_scheduler,
    run_scheduler_checks,
)
from fd_core.testing.conformance.token_processor import (
    TOKEN_PROCESSOR_CHECKS,
    check_token_processor,
    run_token_processor_checks,
    tiny_tokenizer,
)
from fd_core.testing.conformance.tool_parser import (
    TOOL_PARSER_CHECKS,
    check_tool_parser,
    run_tool_parser_checks,
)

__all__ = [
    "ARCHITECTURE_CHECKS",
    "CONNECTOR_CHECKS",
    "DEFAULT_LIMITS",
    "GUIDED_DECODING_CHECKS",
    "PLATFORM_CHECKS",
    "PROPOSER_CHECKS",
    "REASONING_PARSER_CHECKS",
    "SCHEDULER_CHECKS",
    "TOKEN_PROCESSOR_CHECKS",
    "TOOL_PARSER_CHECKS",
    "CheckResult",
    "ConformanceError",
    "ConformanceReport",
    "InMemoryPeerDirectory",
    "PeerBoard",
    "SeamReport",
    "check_architecture",
    "check_connector",
    "check_guided_decoding",
    "check_names",
    "check_platform",
    "check_proposer",
    "check_reasoning_parser",
    "check_resource_manager",
    "check_scheduler",
    "check_token_processor",
    "check_tool_parser",
    "directory_scheduler",
    "kit_vocabulary",
    "run_architecture_checks",
    "run_connector_checks",
    "run_guided_decoding_checks",
    "run_platform_checks",
    "run_proposer_checks",
    "run_reasoning_parser_checks",
    "run_plugin_checks",
    "run_resource_manager_checks",
    "run_scheduler_checks",
    "run_token_processor_checks",
    "run_tool_parser_checks",
    "tiny_tokenizer",
]
