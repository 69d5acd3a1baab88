"""A stand-in for DCGM's ``dcgmi diag -r 1`` on the tunnel bed's nodes, which have no GPUs: it prints the result
table ``dcgmi`` prints (the layout of the DCGM user guide's diagnostics chapter: metadata rows, then one row per
deployment test with ``Pass``, ``Fail - GPU: N`` or ``Skip``) and, as ``dcgmi`` does when a test fails, exits
non-zero (226, DCGM_ST_NVVS_ERROR as an exit status).

``python -m tests.harness.dcgmi diag -r 1 [--fail TEST]``: ``--fail`` names the deployment test that fails on GPU 0.
"""

from __future__ import annotations

import argparse
import sys

DEPLOYMENT_TESTS = ("Denylist", "NVML Library", "CUDA Main Library", "Permissions and OS Blocks", "Persistence Mode",
                    "Environment Variables", "Page Retirement/Row Remap", "Graphics Processes", "Inforom")
FAILED_EXIT = 226


def table(failing: str) -> list[str]:
    rule = "+---------------------------+------------------------------------------------+"
    rows = [("DCGM Version", "3.3.9"), ("Driver Version Detected", "550.127.05"), ("GPU Device IDs Detected", "27b8")]
    lines = ["Successfully ran diagnostic for group.", rule, "| Diagnostic                | Result"
             "                                         |", rule.replace("-", "="),
             "|-----  Metadata  ----------+------------------------------------------------|"]
    lines += [f"| {name:<25} | {value:<46} |" for name, value in rows]
    lines.append("|-----  Deployment  --------+------------------------------------------------|")
    lines += [f"| {test:<25} | {'Fail - GPU: 0' if test == failing else 'Pass':<46} |" for test in DEPLOYMENT_TESTS]
    lines.append(rule)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcgmi")
    parser.add_argument("command", choices=["diag"])
    parser.add_argument("-r", dest="level", required=True)
    parser.add_argument("--fail", default="", choices=["", *DEPLOYMENT_TESTS])
    args = parser.parse_args(argv)
    print("\n".join(table(args.fail)), flush=True)
    return FAILED_EXIT if args.fail else 0


if __name__ == "__main__":
    sys.exit(main())
