"Write README.md from nbs/index.ipynb (nbdev_readme needs Quarto, which cannot be installed here)."
import json, pathlib, re
root = pathlib.Path(__file__).resolve().parents[1]
nb = json.loads((root / "nbs" / "index.ipynb").read_text())
parts = []
for c in nb["cells"]:
    src = "".join(c["source"]).strip()
    if c["cell_type"] == "markdown": parts.append(src)
    elif src.startswith("#| echo: false"):
        # a picture-drawing cell: the README shows the picture it saved, not its code
        parts += [f"![](nbs/{m})" for m in dict.fromkeys(re.findall(r"images/[\w.-]+\.png", src))]
    elif not src.startswith("#| default_exp"):
        parts.append("```python\n" + "\n".join(l for l in src.splitlines() if not l.startswith("#|")) + "\n```")
(root / "README.md").write_text("\n\n".join(parts) + "\n")
