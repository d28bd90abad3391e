"""Probe: every `af.<name>` / `af.<mod>.<name>` the README and docs use resolves under the new API."""
import glob, re, sys
import ampfunc as af
files = ["README.md", "API.md"] + glob.glob("docs/**/*.md", recursive=True) + glob.glob("docs/**/*.rst", recursive=True) + glob.glob("ampfunc/examples/*.py")
bad = {}
for f in files:
    text = open(f).read()
    for m in re.finditer(r"\baf\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)", text):
        obj, ok = af, True
        for part in m.group(1).split("."):
            if not hasattr(obj, part):
                ok = False
                break
            obj = getattr(obj, part)
            if not isinstance(obj, type(af)):
                break  # attributes of a class/function: not checked
        if not ok:
            line = text[:m.start()].count("\n") + 1
            bad.setdefault(m.group(0), []).append(f"{f}:{line}")
for name, where in sorted(bad.items()):
    print(f"{name}: {', '.join(where[:4])}{' ...' if len(where) > 4 else ''}")
print(len(bad), "unresolved names")
