"""Pretrain a BERT model with megatron-core and a megatron-2bw pipeline schedule.

Not available yet: BERT pretraining (megatron-core's BertModel, masked-LM and binary heads,
its BERT dataset) comes with the BERT issue. Use pretrain_gpt_2bw.py meanwhile.
"""

import sys


def main() -> int:
    print("error: pretrain_bert_2bw.py is not available yet; use pretrain_gpt_2bw.py",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
