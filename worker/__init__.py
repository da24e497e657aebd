"""The inference worker, in five rooms imported down one arrow: serving -> engine -> executor ->
model -> kernels, with main.py on top and three leaves anyone may import (settings, plan, metrics)."""
