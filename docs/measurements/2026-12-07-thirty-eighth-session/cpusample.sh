#!/bin/bash
# prints: epoch busy_jiffies total_jiffies every second
while true; do read -r cpu u n s i w irq sirq st rest < /proc/stat; echo "$(date +%s.%N) $((u+n+s+irq+sirq+st)) $((u+n+s+i+w+irq+sirq+st))"; sleep 1; done
