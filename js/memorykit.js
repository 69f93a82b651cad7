// ComfyUI-MemoryKit frontend extension: shows the Memory Report text on the node after a run.
import { app } from "../../scripts/app.js";

app.registerExtension({
  name: "MemoryKit.Report",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!nodeData?.category?.startsWith("MemoryKit")) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = message?.text?.[0];
      if (!text) return;
      this.memorykitText = text;
      const lines = text.split("\n");
      this.badge = lines.length > 1 ? lines[1] : lines[0];
      this.setDirtyCanvas(true, true);
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      onDrawForeground?.apply(this, arguments);
      if (!this.memorykitText || this.flags?.collapsed) return;
      const lines = this.memorykitText.split("\n");
      ctx.save();
      ctx.font = "11px monospace";
      ctx.fillStyle = "#8fd";
      const y0 = this.size[1] + 14;
      lines.forEach((l, i) => ctx.fillText(l, 6, y0 + 13 * i));
      ctx.restore();
    };
  },
});
