"""schemathesis against a live server, from a test: every check, a bounded run, every failure listed.

`run(document, url)` runs schemathesis's engine (what ``st run --checks all`` runs: the examples,
coverage, fuzzing and stateful phases) against ``url`` with ``document`` and returns a `Report`.
Two settings are ours, and both are about statuses, never about which checks run:

- 413 is a rejection of invalid data (schemathesis's default list omits it; our servers answer 413
  for more items than a published limit, as DESIGN.md says);
- on ``POST /v1/walk-ffn`` a schema-valid request may be 413: its JSON text counts against
  ``max_body_bytes``, which no JSON Schema keyword can state (the rows bound, ``max_rows``, is stated);
- on larql-serve's ``POST /v1/completions`` and ``/v1/chat/completions`` a schema-valid request may
  be 400 (context_length_exceeded): text, as the tokenizer and the chat template make it tokens, must
  fit the context, which no JSON Schema keyword can state either;
- on the embed server's (and the router's) ``POST /v1/logits`` a schema-valid request may be 400:
  ``?masked=`` needs the binary many-rows body (a JSON body cannot carry the token bitmasks), a tie
  between a parameter and the content type that OpenAPI cannot state.

Link inference is off (the stateful phase then runs the links a document declares: none yet).
Each request's timeout, and the max_response_time check's limit, is 10 s unless the caller derives a
longer one from a baseline it measured (a server whose largest legal request takes longer than that on
a loaded host is slow, not failing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import schemathesis
from schemathesis.config import SchemathesisConfig
from schemathesis.config._checks import NEGATIVE_DATA_REJECTION_EXPECTED_STATUSES as REJECTIONS
from schemathesis.config._checks import POSITIVE_DATA_ACCEPTANCE_EXPECTED_STATUSES as ACCEPTANCES
from schemathesis.engine import events, from_schema


@dataclass
class Report:
    cases: int = 0
    failures: dict[tuple[str, str], str] = field(default_factory=dict)  # (operation, title: message) -> curl
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase

    def __str__(self) -> str:
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in self.phases.items())
        lines = [f"{len(self.failures)} failures, {len(self.errors)} errors in {self.cases} cases ({self.seconds:.1f} s: {phases})"]
        lines += [f"- {op}: {what}\n    {curl[:600]}" for (op, what), curl in self.failures.items()]
        lines += [f"- error: {e[:3000]}" for e in self.errors]
        return "\n".join(lines)


def config(url: str, max_examples: int, seed: int, request_timeout: float = 10.0) -> SchemathesisConfig:
    cfg = SchemathesisConfig.from_dict({
        "checks": {"negative_data_rejection": {"expected-statuses": [*REJECTIONS, "413"]}},
        "phases": {"stateful": {"inference": {"algorithms": []}}},
        "operations": [{"include-path": "/v1/walk-ffn",
                        "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTANCES, "413"]}}},
                       *({"include-path": path,
                          "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTANCES, "400"]}}}
                         for path in ("/v1/completions", "/v1/chat/completions",
                                      "/v1/logits", "/v1/{model_id}/logits"))],
    })
    cfg.update(seed=seed, max_failures=None)
    cfg.output.sanitization.update(enabled=False)  # show token_ids and other "secret-looking" names
    # As `st run` does with its options: an override of every project's (and phase's) settings.
    override = cfg.projects.override
    override.update(base_url=url, request_timeout=request_timeout)
    # max_response_time (one of "all") holds every reply to the same bound as the request timeout
    override.checks.update(included_check_names=["all"], max_response_time=request_timeout)
    override.generation.update(max_examples=max_examples, database="none", no_shrink=True)
    return cfg


def run(document: dict, url: str, *, max_examples: int = 5, seed: int = 1, request_timeout: float = 10.0) -> Report:
    schema = schemathesis.openapi.from_dict(document, config=config(url, max_examples, seed, request_timeout))
    schema.config.update(base_url=url)
    report, t0 = Report(), time.monotonic()
    started: dict[str, float] = {}
    for ev in from_schema(schema).execute():
        if isinstance(ev, events.PhaseStarted):
            started[str(getattr(ev.phase.name, "value", ev.phase.name))] = ev.timestamp
        elif isinstance(ev, events.PhaseFinished):
            name = str(getattr(ev.phase.name, "value", ev.phase.name))
            report.phases[name] = ev.timestamp - started.get(name, ev.timestamp)
        elif isinstance(ev, (events.ScenarioFinished, events.FuzzScenarioFinished)):
            report.cases += len(ev.recorder.cases)
            for checks in ev.recorder.checks.values():
                for check in checks:
                    if check.failure_info is not None:
                        f = check.failure_info.failure
                        report.failures.setdefault((f.operation, f"{f.title}: {f.message[:300]}"), check.failure_info.code_sample)
        elif isinstance(ev, events.NonFatalError):
            report.errors.append(f"{ev.label}: {ev.info}")
        elif isinstance(ev, events.FatalError):
            report.errors.append(f"fatal: {ev.exception!r}")
    report.seconds = time.monotonic() - t0
    return report
