#!/usr/bin/env python3
"""check_layout.py: the ctypes Structures in strata.py must have the C
layout of include/strata.h. Compiles a small C program that prints sizeof and
offsetof of every field with the C compiler ($CC, default cc) and compares.

    python3 check_layout.py [INCLUDE_DIR]      (default ../../include)
"""

import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import strata

STRUCTS = {
    "strata_engine_params": strata.EngineParams,
    "strata_model_info": strata.ModelInfoC,
    "strata_session_params": strata.SessionParams,
    "strata_sampling_params": strata.SamplingParams,
}


def main(argv):
    here = Path(__file__).resolve().parent
    include = Path(argv[1]) if len(argv) > 1 else here.parent.parent / "include"
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "strata.h"', "int main(void) {"]
    want = []
    for cname, py in STRUCTS.items():
        lines.append(f'  printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        want.append(f"{cname} sizeof {ctypes.sizeof(py)}")
        for field, _ in py._fields_:
            lines.append(f'  printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
            want.append(f"{cname} {field} {getattr(py, field).offset}")
    # Enums are passed as C int.
    for enum in ("strata_status", "strata_log_level", "strata_kv_type", "strata_gpu_precision", "strata_prefill_help"):
        lines.append(f'  printf("{enum} sizeof %zu\\n", sizeof({enum}));')
        want.append(f"{enum} sizeof {ctypes.sizeof(ctypes.c_int)}")
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "layout.c"), os.path.join(tmp, "layout")
        Path(src).write_text("\n".join(lines) + "\n")
        cc = os.environ.get("CC", "cc")
        subprocess.run([cc, "-std=c99", "-I", str(include), "-o", exe, src], check=True)
        got = subprocess.run([exe], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]
    bad = [f"  C: {g!r:45} ctypes: {w!r}" for g, w in zip(got, want) if g != w]
    if bad or len(got) != len(want):
        print("check_layout: strata.py does not match strata.h:\n" + "\n".join(bad), file=sys.stderr)
        return 1
    print(f"check_layout: {len(want)} sizes and offsets match strata.h")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
