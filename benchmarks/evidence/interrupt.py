"""Ctrl-C evidence: start an attn-doctor command, send it SIGINT after WAIT seconds, and print how long it
took to exit (the process, and both of its output pipes) and with which code.

Usage: python3 benchmarks/evidence/interrupt.py WAIT OUTFILE -- attn-doctor arguments...
(attn-doctor importable: installed, or PYTHONPATH at the project root)
"""

import subprocess
import sys
import time

wait, outfile = float(sys.argv[1]), sys.argv[2]
args = sys.argv[sys.argv.index("--") + 1:]
with open(outfile, "w") as log:
    proc = subprocess.Popen([sys.executable, "-m", "attn_doctor", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(wait)
    sent = time.monotonic()
    proc.send_signal(2)
    code = proc.wait(timeout=60)
    exited = time.monotonic() - sent
    output = proc.stdout.read()
    closed = time.monotonic() - sent
    log.write(output)
    summary = (f"SIGINT after {wait:g} s: exit code {code}, process gone after {exited:.2f} s, "
               f"its output closed after {closed:.2f} s\n")
    log.write(summary)
    print(summary, end="")
