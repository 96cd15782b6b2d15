# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Report formats: `text` (one `path:line:col rule-id message` line per finding), `github` (workflow-command
annotations, `::error file=...::message`) and `sarif` (SARIF 2.1.0 JSON, for code-scanning uploads)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import PurePosixPath

from .model import Finding
from .rules import RULES, SYNTAX_ERROR

__all__ = ["FORMATS", "render"]

FORMATS = ("text", "github", "sarif")

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
TOOL_NAME = "rollout-consistency lint"


def render(findings: Sequence[Finding], fmt: str = "text") -> str:
    """The report in `fmt` (one of `FORMATS`); ends with a newline unless empty (text/github)."""
    if fmt == "text":
        return "".join(f"{finding.format()}\n" for finding in findings)
    if fmt == "github":
        return "".join(_github(finding) + "\n" for finding in findings)
    if fmt == "sarif":
        return json.dumps(sarif(findings), indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def _github(finding: Finding) -> str:
    properties = {
        "file": finding.path,
        "line": finding.line,
        "col": finding.col,
        "endLine": finding.end_line,
        "endColumn": finding.end_col,
        "title": f"rollout-consistency {finding.rule}",
    }
    joined = ",".join(f"{key}={_escape_property(str(value))}" for key, value in properties.items())
    return f"::error {joined}::{_escape_data(f'{finding.rule}: {finding.message}')}"


def _uri(path: str) -> tuple[str, bool]:
    """(URI, relative?) of a reported path: relative paths stay relative to the source root."""
    posix = path.replace("\\", "/")
    if posix.startswith("/"):
        return PurePosixPath(posix).as_uri(), False
    while posix.startswith("./"):
        posix = posix[2:]
    return posix, True


def sarif(findings: Sequence[Finding]) -> dict:
    """The findings as a SARIF 2.1.0 log (one run; every rule described, syntax-error included)."""
    descriptors = [*RULES.values(), SYNTAX_ERROR]
    index = {rule.id: i for i, rule in enumerate(descriptors)}
    results = []
    for finding in findings:
        uri, relative = _uri(finding.path)
        location = {"uri": uri, "uriBaseId": "%SRCROOT%"} if relative else {"uri": uri}
        results.append(
            {
                "ruleId": finding.rule,
                "ruleIndex": index[finding.rule],
                "level": "error",
                "message": {"text": finding.message},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": location,
                            "region": {
                                "startLine": finding.line,
                                "startColumn": finding.col,
                                "endLine": finding.end_line,
                                "endColumn": finding.end_col,
                            },
                        }
                    }
                ],
            }
        )
    rules = [
        {
            "id": rule.id,
            "name": "".join(word.capitalize() for word in rule.id.split("-")),
            "shortDescription": {"text": rule.title},
            "fullDescription": {"text": rule.why},
            "help": {"text": f"Fix: {rule.fix} (docs/lint.md#{rule.id})"},
            "defaultConfiguration": {"level": "error"},
        }
        for rule in descriptors
    ]
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": TOOL_NAME, "rules": rules}},
                "columnKind": "unicodeCodePoints",
                "results": results,
            }
        ],
    }
