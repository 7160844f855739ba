"""A YAML loader that refuses a key given twice (run configs, trainer configs)."""

from __future__ import annotations

import yaml


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: PyYAML keeps the last silently, so
    ``batch: 4`` then ``batch: 8`` would gate a run the user did not mean (issue 22, a fresh battery)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (YAML would keep the last silently)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
